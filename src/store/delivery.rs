//! The values the delivery path's writes take and give, on either backend:
//! the look-up before a send, the provider a failed call went to, and what
//! a webhook dispatcher pass may take and took. They live apart from
//! [`crate::store::Writer`] so that each backend's writer reads them
//! without reaching back into the writer that calls it.

use super::webhooks::{DueCall, Webhook};
use crate::model::MessageStatus;
use crate::store::messages::MessageRecord;

/// A received message to look up before sending (see
/// [`crate::store::Writer::before_send`]).
#[derive(Debug, Clone)]
pub struct SendCheck {
    pub id: String,
    pub tenant_id: String,
    /// The recipient, normalised (`suppressions::normalize`); `None` when
    /// there is none to check.
    pub address: Option<String>,
}

/// What [`crate::store::Writer::before_send`] found for one message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeforeSend {
    /// `None`: the message has no status row.
    pub status: Option<MessageStatus>,
    pub suppressed: bool,
}

/// What a dispatcher pass may take ([`crate::store::Writer::take_pass`]): for each
/// tenant the dispatcher holds state for (calls in flight, a grown or cut
/// limit, a pause), its calls in flight and its room; every other tenant
/// has `default_room` and nothing in flight.
#[derive(Debug, Default)]
pub struct PassRooms {
    pub tenants: std::collections::HashMap<String, TenantRoom>,
    pub default_room: usize,
}

/// One tenant's part of [`PassRooms`].
#[derive(Debug, Default)]
pub struct TenantRoom {
    /// Event ids of its calls in flight: not taken again.
    pub busy: std::collections::HashSet<i64>,
    /// Calls it may start now.
    pub room: usize,
}

impl PassRooms {
    /// The busy calls and room of `tenant`.
    pub(crate) fn of(&self, tenant: &str) -> (Option<&std::collections::HashSet<i64>>, usize) {
        match self.tenants.get(tenant) {
            Some(room) => (Some(&room.busy), room.room),
            None => (None, self.default_room),
        }
    }
}

/// What [`crate::store::Writer::take_pass`] took for one tenant.
pub struct TakenCalls {
    pub tenant: String,
    /// The tenant's room in this pass.
    pub room: usize,
    /// Due calls found for the room (at most the room).
    pub wanted: usize,
    /// Those leased to this instance (another may have taken some).
    pub calls: Vec<DueCall>,
    /// The message's status at each leased call's event, by event id.
    pub data: std::collections::HashMap<i64, MessageRecord>,
    /// The tenant's endpoint as it was when the calls were taken; `None`
    /// when it has none any more.
    pub webhook: Option<Webhook>,
}

/// The provider a failed call went to, as the message's row keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Called<'a> {
    /// Its name in the channel's pool.
    pub provider: &'a str,
    /// True when the call may have reached it (a timeout): the next
    /// attempt must go to the same provider, never to another, so that a
    /// message is not sent by two providers.
    pub pinned: bool,
}
