//! The values the delivery path's writes take and give, on either backend:
//! the look-up before a send, the provider a failed call went to, and what
//! a webhook dispatcher pass may take and took. They live apart from
//! [`crate::store::Writer`] so that each backend's writer reads them
//! without reaching back into the writer that calls it.

use super::webhooks::{Cursor, DueCall, Webhook};
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
/// has `default_room` and nothing in flight. `owner` names this instance's
/// dispatcher: it holds the endpoints' streams it reads (see
/// [`crate::store::webhooks`]).
#[derive(Debug, Default)]
pub struct PassRooms {
    pub tenants: std::collections::HashMap<String, TenantRoom>,
    pub default_room: usize,
    pub owner: String,
    /// Until when a stream read in this pass stays this instance's (a
    /// lease renewed by every pass while it has calls in flight).
    pub stream_until: i64,
}

/// One tenant's part of [`PassRooms`].
#[derive(Debug, Default)]
pub struct TenantRoom {
    /// Event ids of its calls in flight: not taken again.
    pub busy: std::collections::HashSet<i64>,
    /// Messages with a call in flight: their later events wait for it.
    pub busy_messages: std::collections::HashSet<String>,
    /// Calls it may start now.
    pub room: usize,
}

impl PassRooms {
    /// `tenant`'s part: its calls and messages in flight (none when absent)
    /// and its room.
    pub(crate) fn of(&self, tenant: &str) -> (Option<&TenantRoom>, usize) {
        match self.tenants.get(tenant) {
            Some(room) => (Some(room), room.room),
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
    /// Those leased to this instance (another may have taken some), the
    /// failed calls' retries first, then the stream's events in order.
    pub calls: Vec<DueCall>,
    /// The message's status at each leased call's event, by event id.
    pub data: std::collections::HashMap<i64, MessageRecord>,
    /// The tenant's endpoint as it was when the calls were taken; `None`
    /// when it has none any more.
    pub webhook: Option<Webhook>,
    /// The endpoint's stream, when this instance holds it.
    pub stream: Option<StreamRead>,
}

/// How far a pass read an endpoint's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRead {
    /// The stream's lease was taken anew, so the read began again at its
    /// position: calls this instance took from it before are no longer
    /// what the position waits for.
    pub fresh: bool,
    /// Every event up to here was taken, held behind its message's failed
    /// call, or is of a type the endpoint does not want.
    pub read: Cursor,
}

/// What the dispatcher's recorder writes in one go
/// ([`crate::store::Writer::record_calls`]).
#[derive(Debug, Default)]
pub struct CallsRecord {
    /// Failed calls' retries that were delivered: their rows go.
    pub delivered_rows: Vec<i64>,
    /// Tenants whose endpoint answered 2xx: no longer failing.
    pub healthy: Vec<String>,
    /// Streams' new positions, by tenant; a position only moves forward.
    pub positions: Vec<(String, Cursor)>,
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

/// The tenants a dispatcher pass visits: those with failed calls due
/// (`pending`), those whose stream has something to read (`streams`), and
/// those the dispatcher holds state for (a stream with calls in flight has
/// its lease renewed even when nothing new has come); each once.
pub(crate) fn tenants_to_visit(
    pending: Vec<Option<String>>,
    streams: Vec<String>,
    rooms: &PassRooms,
) -> Vec<String> {
    let mut tenants: Vec<String> = pending.into_iter().flatten().collect();
    tenants.extend(streams);
    tenants.extend(rooms.tenants.keys().cloned());
    tenants.sort();
    tenants.dedup();
    tenants
}

/// One tenant's stream in a dispatcher pass.
pub(crate) struct StreamPass<'a> {
    pub tenant: &'a str,
    /// This instance's dispatcher.
    pub owner: &'a str,
    pub busy: Option<&'a TenantRoom>,
    /// Calls it may still start.
    pub room: usize,
    pub now: i64,
    /// The lease's end, if this pass takes or keeps it.
    pub lease_until: i64,
}

/// An event a stream read found past its read, wanted by its endpoint.
#[derive(Debug, Clone)]
pub(crate) struct NextEvent {
    pub cursor: Cursor,
    pub message_id: String,
    /// The event's word (`sent`, `delivered`, …).
    pub event: String,
    pub at: i64,
    /// Its message has a failed call's row: the event waits behind it.
    pub held: bool,
}

/// What a stream read makes of the events it found.
#[derive(Debug, Default)]
pub(crate) struct ReadPlan {
    /// The calls to make, in order.
    pub calls: Vec<DueCall>,
    /// The events to hold, as rows, behind their message's failed call.
    pub holds: Vec<NextEvent>,
    /// How far the stream is read after this.
    pub read: Cursor,
}

impl StreamPass<'_> {
    /// Plans a read from `read` over `next` (in stream order, at most the
    /// room) and `top`, the newest event the stream may pass: each event
    /// becomes a call, or a row held behind its message's failed call;
    /// the read stops before an event whose message has a call in flight
    /// or taken just before (its earlier event's call must end first).
    /// When fewer than the room were found and none stopped the read, it
    /// passes up to `top` (the events the endpoint does not want).
    pub(crate) fn plan(&self, read: Cursor, next: Vec<NextEvent>, top: Option<Cursor>) -> ReadPlan {
        let whole = next.len() < self.room;
        let mut busy: std::collections::HashSet<String> = self
            .busy
            .map(|busy| busy.busy_messages.clone())
            .unwrap_or_default();
        let mut plan = ReadPlan {
            read,
            ..ReadPlan::default()
        };
        for event in next {
            if event.held {
                plan.read = event.cursor;
                plan.holds.push(event);
                continue;
            }
            if !busy.insert(event.message_id.clone()) {
                return plan;
            }
            plan.read = event.cursor;
            plan.calls.push(DueCall {
                event_id: event.cursor.1,
                tenant_id: self.tenant.to_owned(),
                message_id: event.message_id,
                kind: format!("message.{}", event.event),
                created_at: event.at,
                attempts: 0,
                cursor: Some(event.cursor),
            });
        }
        if whole && let Some(top) = top {
            plan.read = plan.read.max(top);
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: i64, message: &str, held: bool) -> NextEvent {
        NextEvent {
            cursor: (0, id),
            message_id: message.into(),
            event: "sent".into(),
            at: 0,
            held,
        }
    }

    /// A read makes calls in order, holds an event whose message has a
    /// failed call's row, stops before a message already in flight, and
    /// passes up to the newest event only when nothing stopped it.
    #[test]
    fn a_read_plans_calls_holds_and_where_it_stops() {
        let busy = TenantRoom {
            busy_messages: ["m9".to_owned()].into(),
            ..TenantRoom::default()
        };
        let pass = StreamPass {
            tenant: "t",
            owner: "a",
            busy: Some(&busy),
            room: 10,
            now: 0,
            lease_until: 0,
        };
        let plan = pass.plan(
            (0, 0),
            vec![
                event(1, "m1", false),
                event(2, "m2", true),
                event(3, "m1", false),
            ],
            Some((0, 20)),
        );
        let called: Vec<i64> = plan.calls.iter().map(|call| call.event_id).collect();
        assert_eq!(called, [1], "m1's second event waits for its first");
        assert_eq!(plan.holds.len(), 1);
        assert_eq!(plan.read, (0, 2), "stopped before event 3, not at the top");
        let plan = pass.plan((0, 0), vec![event(1, "m9", false)], Some((0, 20)));
        assert!(plan.calls.is_empty(), "m9 has a call in flight");
        assert_eq!(plan.read, (0, 0));
        let plan = pass.plan((0, 0), vec![event(1, "m1", false)], Some((0, 20)));
        assert_eq!(
            plan.read,
            (0, 20),
            "fewer than the room: up to the newest event"
        );
    }
}
