//! The counters of a usage row, shared by both backends' statements: a
//! leaf, so the modules that write usage and those that read it need
//! nothing of each other.

/// The counters, in column order.
pub(crate) const COUNTERS: [&str; 13] = [
    "accepted",
    "sent",
    "delivered",
    "bounced",
    "complained",
    "failed",
    "dead_lettered",
    "suppressed",
    "cancelled",
    "rejected",
    "fragments",
    "attachment_bytes",
    "redriven",
];
