//! Email attachments: which files an email may carry, how an upload is
//! checked and streamed into the store, and how big they may be.
//!
//! A file is uploaded on its own (`POST /v1/attachments`, the bytes as the
//! body, its type in `Content-Type`, its name in `?filename=`) and named by
//! its id in a send's `attachments`. Its type must be on [`ALLOWED`] and
//! agree three ways: the claimed type, the name's extension, and the first
//! bytes (magic numbers, told by `infer`; a text type must be UTF-8 with
//! no NUL). Its name is cleaned of paths and of characters a mail client
//! or a file system could misread ([`clean_filename`]). The body is read a
//! frame at a time and written in chunks of
//! [`crate::store::attachments::CHUNK_BYTES`], so an upload holds at most
//! one chunk in memory, and one past [`MAX_FILE_BYTES`] is refused (413)
//! as soon as its `Content-Length` says so or its bytes pass the limit.
//!
//! The limits keep an email within SES's 40 MB raw message: at most
//! [`MAX_FILES`] files of [`MAX_TOTAL_BYTES`] in all, which base64 makes
//! about 33.4 MB, beside at most 160 KiB of text and HTML.

use axum::body::Body;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};

use crate::model::{Scope, now_ms};
use crate::store::Db;
use crate::store::attachments::{AttachmentRow, CHUNK_BYTES};

/// Largest file, in bytes (10 MiB).
pub const MAX_FILE_BYTES: u64 = 10 * 1024 * 1024;
/// Most files on one email.
pub const MAX_FILES: usize = crate::message::MAX_ATTACHMENTS;
/// Largest sum of one email's files, in bytes (25 MiB).
pub const MAX_TOTAL_BYTES: i64 = 25 * 1024 * 1024;
/// Longest file name kept, in characters.
pub const MAX_FILENAME_CHARS: usize = 100;
/// How long a file serves sends after its upload (ms): a day.
pub const USABLE_FOR_MS: i64 = 24 * 60 * 60 * 1000;
/// How many first bytes the type is told from.
const SNIFF_BYTES: usize = 8 * 1024;

/// How a type's content is recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    /// By its magic number, as `infer` names it.
    Magic(&'static str),
    /// UTF-8 text without NUL bytes.
    Text,
    /// Text that starts (after white space) with this.
    TextStarting(&'static [&'static str]),
}

/// A type an attachment may have.
#[derive(Debug)]
pub struct AllowedType {
    pub content_type: &'static str,
    pub extensions: &'static [&'static str],
    content: Content,
}

/// The types an email may carry, with the extensions their names may end
/// in: documents, images and the text formats products send (a receipt's
/// PDF, a CSV export, a calendar invitation).
pub const ALLOWED: &[AllowedType] = &[
    AllowedType {
        content_type: "application/pdf",
        extensions: &["pdf"],
        content: Content::Magic("application/pdf"),
    },
    AllowedType {
        content_type: "image/png",
        extensions: &["png"],
        content: Content::Magic("image/png"),
    },
    AllowedType {
        content_type: "image/jpeg",
        extensions: &["jpg", "jpeg"],
        content: Content::Magic("image/jpeg"),
    },
    AllowedType {
        content_type: "image/gif",
        extensions: &["gif"],
        content: Content::Magic("image/gif"),
    },
    AllowedType {
        content_type: "text/plain",
        extensions: &["txt"],
        content: Content::Text,
    },
    AllowedType {
        content_type: "text/csv",
        extensions: &["csv"],
        content: Content::Text,
    },
    AllowedType {
        content_type: "text/calendar",
        extensions: &["ics"],
        content: Content::TextStarting(&["BEGIN:VCALENDAR"]),
    },
    AllowedType {
        content_type: "application/json",
        extensions: &["json"],
        content: Content::TextStarting(&["{", "["]),
    },
];

/// Why an upload was refused; the API maps each to its status.
#[derive(Debug, thiserror::Error)]
pub enum UploadRefused {
    /// The claimed type is not on the allow-list (415).
    #[error("{0}")]
    Type(String),
    /// A field is wrong (422): `filename` or `body`.
    #[error("{field}: {message}")]
    Field {
        field: &'static str,
        message: String,
    },
    /// Past [`MAX_FILE_BYTES`] (413).
    #[error("the file is larger than {MAX_FILE_BYTES} bytes")]
    TooLarge,
    /// The body could not be read (400, or 503 past the deadline).
    #[error("the body could not be read")]
    Body(#[source] axum::Error),
    /// The tenant's files in this world would hold more than `limit`
    /// bytes (its plan's `upload_bytes_held`); they hold `held` without it.
    #[error("the files would hold more than {limit} bytes")]
    Held { held: i64, limit: i64 },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

impl UploadRefused {
    fn field(field: &'static str, message: impl Into<String>) -> Self {
        UploadRefused::Field {
            field,
            message: message.into(),
        }
    }
}

/// The allowed type `content_type` names (parameters and case ignored).
pub fn allowed_type(content_type: &str) -> Option<&'static AllowedType> {
    let essence = crate::model::media_type(content_type);
    ALLOWED.iter().find(|t| t.content_type == essence)
}

/// `name` as an attachment's file name: its last path segment, without
/// control characters or any of `"*/:<>?\|`, without leading or trailing
/// dots and spaces, cut to [`MAX_FILENAME_CHARS`] keeping its extension;
/// none when nothing is left.
pub fn clean_filename(name: &str) -> Option<String> {
    let last = name.rsplit(['/', '\\']).next().unwrap_or("");
    let kept: String = last
        .chars()
        .filter(|c| !c.is_control() && !"\"*/:<>?\\|".contains(*c))
        .collect();
    let trimmed = kept.trim_matches(|c: char| c == '.' || c.is_whitespace());
    if trimmed.is_empty() {
        return None;
    }
    if trimmed.chars().count() <= MAX_FILENAME_CHARS {
        return Some(trimmed.to_owned());
    }
    let (stem, extension) = match trimmed.rsplit_once('.') {
        Some((stem, ext)) if ext.chars().count() <= 10 => (stem, format!(".{ext}")),
        _ => (trimmed, String::new()),
    };
    let room = MAX_FILENAME_CHARS - extension.chars().count();
    let stem: String = stem.chars().take(room).collect();
    Some(format!("{}{extension}", stem.trim_end()))
}

/// Checks that `name`'s extension is one of `allowed`'s.
fn check_extension(name: &str, allowed: &AllowedType) -> Result<(), UploadRefused> {
    let extension = name
        .rsplit_once('.')
        .map(|(_, ext)| ext.to_ascii_lowercase());
    if extension.is_some_and(|ext| allowed.extensions.contains(&ext.as_str())) {
        return Ok(());
    }
    let listed: Vec<String> = allowed.extensions.iter().map(|e| format!(".{e}")).collect();
    Err(UploadRefused::field(
        "filename",
        format!(
            "must end in {} for {}",
            listed.join(" or "),
            allowed.content_type
        ),
    ))
}

/// Checks that `head` (a file's first bytes, or all of a shorter one)
/// is what `allowed` says.
fn check_content(head: &[u8], allowed: &AllowedType) -> Result<(), UploadRefused> {
    let seen = infer::get(head).map(|kind| kind.mime_type());
    let fits = match allowed.content {
        Content::Magic(mime) => seen == Some(mime),
        Content::Text => seen.is_none() && is_text(head),
        Content::TextStarting(starts) => {
            seen.is_none() && is_text(head) && {
                let valid = match std::str::from_utf8(head) {
                    Ok(text) => text,
                    Err(err) => std::str::from_utf8(&head[..err.valid_up_to()]).unwrap_or(""),
                };
                let text = valid.trim_start_matches('\u{feff}').trim_start();
                starts.iter().any(|start| text.starts_with(start))
            }
        }
    };
    if fits {
        return Ok(());
    }
    let found = match (seen, allowed.content) {
        (Some(mime), _) => format!("its bytes are {mime}"),
        (None, Content::Magic(_)) => "its bytes are of no type it recognises".to_owned(),
        (None, _) if !is_text(head) => "its bytes are not UTF-8 text without NUL bytes".to_owned(),
        (None, Content::TextStarting(starts)) => {
            format!("its text does not start with {}", starts.join(" or "))
        }
        (None, Content::Text) => "its bytes are not text".to_owned(),
    };
    Err(UploadRefused::field(
        "body",
        format!(
            "is not {} {} file: {found}",
            article(allowed.content_type),
            allowed.content_type
        ),
    ))
}

/// "an" before a word that starts with a vowel, else "a".
fn article(word: &str) -> &'static str {
    match word.chars().next().map(|c| c.to_ascii_lowercase()) {
        Some('a' | 'e' | 'i' | 'o' | 'u') => "an",
        _ => "a",
    }
}

/// UTF-8 without NUL bytes.
fn is_text(head: &[u8]) -> bool {
    if head.contains(&0) {
        return false;
    }
    match std::str::from_utf8(head) {
        Ok(_) => true,
        // A character may be cut where the head was cut from the file.
        Err(err) => err.error_len().is_none() && head.len() >= SNIFF_BYTES,
    }
}

/// An upload as asked: the scope, the claimed type, the name, the
/// declared length, if any, and the most bytes the scope's files may hold
/// with it (the plan's `upload_bytes_held`).
pub struct Upload<'a> {
    pub scope: &'a Scope,
    pub content_type: Option<&'a str>,
    pub filename: Option<&'a str>,
    pub content_length: Option<u64>,
    pub held_at_most: i64,
}

/// Checks `upload` and streams `body` into the store; the finished file's
/// row. Nothing of a refused upload stays in the store.
///
/// The bytes its world's files hold are checked three times: against the
/// declared length before a byte is read, as the bytes stream in, and at
/// the finish, in one step with every other finish of the world (two
/// uploads under way at once may each have fitted alone).
pub async fn receive(
    db: &Db,
    upload: Upload<'_>,
    body: Body,
) -> Result<AttachmentRow, UploadRefused> {
    let allowed = match upload.content_type {
        None => {
            return Err(UploadRefused::Type(
                "Content-Type must name the file's type".into(),
            ));
        }
        Some(claimed) => allowed_type(claimed).ok_or_else(|| {
            let names: Vec<&str> = ALLOWED.iter().map(|t| t.content_type).collect();
            UploadRefused::Type(format!(
                "Content-Type {claimed:?} is not a type an attachment may have ({})",
                names.join(", ")
            ))
        })?,
    };
    let filename = match upload.filename {
        None => return Err(UploadRefused::field("filename", "is required")),
        Some(name) => clean_filename(name).ok_or_else(|| {
            UploadRefused::field("filename", "must name a file (it is empty once cleaned)")
        })?,
    };
    check_extension(&filename, allowed)?;
    if upload.content_length.is_some_and(|n| n > MAX_FILE_BYTES) {
        return Err(UploadRefused::TooLarge);
    }
    let limit = upload.held_at_most;
    let held = db.held_attachment_bytes(upload.scope).await?;
    let declared = upload.content_length.map_or(1, |n| n.max(1) as i64);
    if held.saturating_add(declared) > limit {
        return Err(UploadRefused::Held { held, limit });
    }
    let mut reader = Frames::new(body);
    let head = reader.fill(SNIFF_BYTES).await?;
    if head.is_empty() {
        return Err(UploadRefused::field("body", "must not be empty"));
    }
    check_content(head, allowed)?;
    let created_at = now_ms();
    let row = AttachmentRow {
        id: format!("att_{}", uuid::Uuid::now_v7().simple()),
        tenant_id: upload.scope.tenant().to_owned(),
        test: upload.scope.is_test(),
        filename,
        content_type: allowed.content_type.to_owned(),
        size: 0,
        sha256: None,
        messages: 0,
        created_at,
        expires_at: created_at + USABLE_FOR_MS,
    };
    db.begin_attachment(&row).await?;
    let stored = match store_chunks(db, &row.id, &mut reader, (held, limit)).await {
        Ok((size, sha256)) => match db.finish_attachment(&row.id, size, &sha256, limit).await {
            Ok(true) => Ok((size, sha256)),
            Ok(false) => {
                // Others finished meanwhile: the world is fuller than at
                // the start.
                let held = db.held_attachment_bytes(upload.scope).await.unwrap_or(held);
                Err(UploadRefused::Held { held, limit })
            }
            Err(err) => Err(err.into()),
        },
        Err(refused) => Err(refused),
    };
    match stored {
        Ok((size, sha256)) => Ok(AttachmentRow {
            size,
            sha256: Some(sha256),
            ..row
        }),
        Err(refused) => {
            if let Err(err) = db.drop_attachment(&row.id).await {
                tracing::warn!(error = %err, id = %row.id, "could not remove a refused upload; the stale-file sweep will");
            }
            Err(refused)
        }
    }
}

/// Writes the body's bytes as chunks; their total size and SHA-256. Past
/// [`MAX_FILE_BYTES`] it stops with `TooLarge`, past what the world may
/// still hold (`held` of `limit`) with `Held`.
async fn store_chunks(
    db: &Db,
    id: &str,
    reader: &mut Frames,
    (held, limit): (i64, i64),
) -> Result<(i64, String), UploadRefused> {
    let mut hash = Sha256::new();
    let mut size: u64 = 0;
    let mut seq = 0i64;
    loop {
        let chunk = reader.fill(CHUNK_BYTES).await?;
        if chunk.is_empty() {
            break;
        }
        size += chunk.len() as u64;
        if size > MAX_FILE_BYTES {
            return Err(UploadRefused::TooLarge);
        }
        if held.saturating_add(size as i64) > limit {
            return Err(UploadRefused::Held { held, limit });
        }
        hash.update(chunk);
        let data = reader.take();
        db.add_attachment_chunk(id, seq, data).await?;
        seq += 1;
    }
    Ok((size as i64, hex::encode(hash.finalize())))
}

/// A body read a frame at a time into a buffer of at most the size asked
/// (plus what one frame brings past it).
struct Frames {
    body: Body,
    buffer: Vec<u8>,
    ended: bool,
}

impl Frames {
    fn new(body: Body) -> Self {
        Frames {
            body,
            // A chunk and a frame past it: the buffer never grows again.
            buffer: Vec::with_capacity(CHUNK_BYTES + 64 * 1024),
            ended: false,
        }
    }

    /// Reads until the buffer holds `want` bytes or the body ends; the
    /// first `want` bytes buffered (fewer at the end).
    async fn fill(&mut self, want: usize) -> Result<&[u8], UploadRefused> {
        while self.buffer.len() < want && !self.ended {
            match self.body.frame().await {
                None => self.ended = true,
                Some(Err(err)) => return Err(UploadRefused::Body(err)),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
            }
        }
        let end = want.min(self.buffer.len());
        Ok(&self.buffer[..end])
    }

    /// Takes the first chunk's worth of the buffer (what the last `fill`
    /// returned) as a vector of its exact size, leaving the rest for the
    /// next in the same buffer.
    fn take(&mut self) -> Vec<u8> {
        let end = CHUNK_BYTES.min(self.buffer.len());
        self.buffer.drain(..end).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_lose_paths_and_unsafe_characters_and_keep_their_extension() {
        assert_eq!(
            clean_filename("../../etc/passwd.txt").as_deref(),
            Some("passwd.txt")
        );
        assert_eq!(
            clean_filename("C:\\Users\\a\\report.pdf").as_deref(),
            Some("report.pdf")
        );
        assert_eq!(
            clean_filename("in\"voice\r\n<1>.pdf").as_deref(),
            Some("invoice1.pdf")
        );
        assert_eq!(clean_filename(" ..hidden. ").as_deref(), Some("hidden"));
        assert_eq!(clean_filename("../.."), None);
        let long = format!("{}.pdf", "x".repeat(300));
        let cut = clean_filename(&long).unwrap();
        assert_eq!(cut.chars().count(), MAX_FILENAME_CHARS);
        assert!(cut.ends_with(".pdf"));
    }

    #[test]
    fn a_type_must_agree_with_the_name_and_the_bytes() {
        let pdf = allowed_type("application/PDF; name=x").unwrap();
        assert!(check_extension("a.PDF", pdf).is_ok());
        assert!(check_extension("a.png", pdf).is_err());
        assert!(check_content(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n", pdf).is_ok());
        assert!(check_content(b"MZ\x90\x00 an executable", pdf).is_err());
        let png = allowed_type("image/png").unwrap();
        assert!(check_content(b"%PDF-1.7\n", png).is_err());
        let csv = allowed_type("text/csv").unwrap();
        assert!(check_content("name,city\nZoë,Genève\n".as_bytes(), csv).is_ok());
        assert!(check_content(b"name\x00city", csv).is_err());
        assert!(check_content(b"%PDF-1.7\n", csv).is_err());
        let ics = allowed_type("text/calendar").unwrap();
        assert!(check_content(b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\n", ics).is_ok());
        assert!(check_content(b"hello", ics).is_err());
        assert!(allowed_type("application/x-msdownload").is_none());
    }

    #[test]
    fn a_refusal_names_the_type_with_its_article_in_a_whole_sentence() {
        let said = |head: &[u8], allowed: &AllowedType| match check_content(head, allowed) {
            Err(UploadRefused::Field { message, .. }) => message,
            other => panic!("{other:?}"),
        };
        let png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR";
        assert_eq!(
            said(png, allowed_type("application/pdf").unwrap()),
            "is not an application/pdf file: its bytes are image/png"
        );
        assert_eq!(
            said(b"a\x00b", allowed_type("text/plain").unwrap()),
            "is not a text/plain file: its bytes are not UTF-8 text without NUL bytes"
        );
    }
}
