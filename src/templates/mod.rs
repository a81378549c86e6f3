//! A tenant's templates: what one holds and the checks it passes, how a
//! send's locale picks a variant, and how personalisation fills it.
//!
//! A template has versions; each version is its whole content
//! ([`TemplateContent`]: name, channel, optional priority and lane, the
//! default variant and locale variants), kept as JSON by the store. A send
//! by template names it and, optionally, a version and a locale; it is
//! checked and rendered once at accept (to refuse a missing placeholder or
//! an oversized result with the field named, and to count an SMS's
//! fragments), and the message keeps only the template's id, its version
//! and the personalisation. It is rendered again at delivery from the same
//! immutable version, so no rendered body is ever stored.
//!
//! [`Templates`] reads versions through a cache: a version never changes,
//! so it is kept once read; a template's newest version is read again
//! after [`LATEST_FOR`], so an edit on another instance is used within that.

pub mod placeholders;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use self::placeholders::{Escape, Unit};
pub use crate::message::is_locale;
use crate::message::{
    MAX_EMAIL_BODY_BYTES, MAX_EMAIL_PART_BYTES, MAX_SMS_CHARS, MAX_SUBJECT_CHARS,
};
use crate::model::{Channel, Lane, Priority};
use crate::store::{Db, StoreResult};

/// Longest template name, in characters.
pub const MAX_NAME_CHARS: usize = 100;
/// Most locale variants besides the default.
pub const MAX_LOCALES: usize = 20;
/// Most distinct placeholders in one template (all variants together).
pub const MAX_PLACEHOLDERS: usize = 100;
/// How long a template's newest version is used before it is read again.
pub const LATEST_FOR: Duration = Duration::from_secs(1);
/// Versions kept in memory; past it the cache starts again empty.
const CACHED_VERSIONS: usize = 10_000;

type Errors = BTreeMap<String, String>;

/// One variant of a template: the default one or a locale's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    /// Email: the subject line, with placeholders; required, not blank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(
        min_length = 1,
        max_length = 998,
        pattern = r"^[^\r\n\uFFFE\uFFFF]*[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFFFE\uFFFF][^\r\n\uFFFE\uFFFF]*$"
    )]
    pub subject: Option<String>,
    /// The plain text, with placeholders, not blank; required, but for an
    /// email with HTML, whose text is then derived from the rendered HTML.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(
        min_length = 1,
        pattern = r"^[^\uFFFE\uFFFF]*[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFFFE\uFFFF][^\uFFFE\uFFFF]*$"
    )]
    pub text: Option<String>,
    /// Email: an HTML part, with placeholders (their values are escaped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub html: Option<String>,
}

/// A template as created or replaced, and as each version keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateContent {
    /// 1-100 characters, unique among the tenant's templates, without
    /// spaces around or control characters. (The pattern lists the white
    /// space `trim` takes off one by one rather than `\s`, which regex
    /// engines read differently.)
    #[schema(
        min_length = 1,
        max_length = 100,
        pattern = r"^[^\u0000-\u0020\u007F-\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000](?:[^\u0000-\u001F\u007F-\u009F]*[^\u0000-\u0020\u007F-\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000])?$"
    )]
    pub name: String,
    pub channel: Channel,
    /// The priority every send of it gets, whatever the send asks (a
    /// password reset is always `high`); without it, the send's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// The lane every send of it takes; without it, the tenant's plan's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<Lane>,
    /// Email: the default subject line, not blank. `((name))` is a
    /// placeholder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(
        min_length = 1,
        max_length = 998,
        pattern = r"^[^\r\n\uFFFE\uFFFF]*[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFFFE\uFFFF][^\r\n\uFFFE\uFFFF]*$"
    )]
    pub subject: Option<String>,
    /// The default plain text (an SMS's text), not blank; an email with
    /// HTML may leave it out to have it derived from the rendered HTML.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(
        min_length = 1,
        pattern = r"^[^\uFFFE\uFFFF]*[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFFFE\uFFFF][^\uFFFE\uFFFF]*$"
    )]
    pub text: Option<String>,
    /// Email: the default HTML part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub html: Option<String>,
    /// Variants by locale (`fr`, `fr-CA`, at most 20). A send's `locale`
    /// takes the variant of the same name, then of its language
    /// (`fr-CA` → `fr`), then the default.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub locales: BTreeMap<String, Variant>,
}

/// A template rendered for one send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The locale variant used (none: the default).
    pub locale: Option<String>,
    pub subject: Option<String>,
    pub text: String,
    pub html: Option<String>,
}

impl TemplateContent {
    /// The default variant.
    fn default_variant(&self) -> Variant {
        Variant {
            subject: self.subject.clone(),
            text: self.text.clone(),
            html: self.html.clone(),
        }
    }

    /// Every check a template passes before it is stored; each bad field
    /// named (`subject`, `locales.fr.text`, …).
    pub fn check(&self) -> Result<(), Errors> {
        let mut errors = Errors::new();
        let name = self.name.trim();
        if name.is_empty() || name.chars().count() > MAX_NAME_CHARS || name != self.name {
            errors.insert(
                "name".into(),
                format!("must be 1-{MAX_NAME_CHARS} characters, without spaces around"),
            );
        } else if self.name.chars().any(char::is_control) {
            errors.insert("name".into(), "must not contain control characters".into());
        }
        if self.locales.len() > MAX_LOCALES {
            errors.insert(
                "locales".into(),
                format!("must have at most {MAX_LOCALES} variants"),
            );
        }
        let mut seen = BTreeSet::new();
        for locale in self.locales.keys() {
            if !is_locale(locale) {
                errors.insert(
                    format!("locales.{}", crate::message::field_name(locale)),
                    "is not a locale like fr or fr-CA".into(),
                );
            } else if !seen.insert(locale.to_ascii_lowercase()) {
                errors.insert(
                    format!("locales.{locale}"),
                    "is given twice, in another case".into(),
                );
            }
        }
        self.check_variant("", &self.default_variant(), &mut errors);
        for (locale, variant) in &self.locales {
            self.check_variant(&format!("locales.{locale}."), variant, &mut errors);
        }
        if errors.is_empty() && self.placeholders().len() > MAX_PLACEHOLDERS {
            errors.insert(
                "text".into(),
                format!("the template has more than {MAX_PLACEHOLDERS} distinct placeholders"),
            );
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// One variant's parts checked for the template's channel; errors
    /// named with `prefix`.
    fn check_variant(&self, prefix: &str, variant: &Variant, errors: &mut Errors) {
        let mut refuse = |field: &str, why: String| {
            errors.insert(format!("{prefix}{field}"), why);
        };
        let parse = |field: &str, text: &str, refuse: &mut dyn FnMut(&str, String)| {
            if let Err(why) = placeholders::pieces(text) {
                refuse(field, why);
            }
        };
        let derived = self.channel == Channel::Email && variant.html.is_some();
        match variant.text.as_deref() {
            None if derived => {}
            None => refuse("text", "is required".into()),
            Some(text) if text.trim().is_empty() => refuse("text", "must not be empty".into()),
            Some(text) => parse("text", text, &mut refuse),
        }
        match self.channel {
            Channel::Sms => {
                if variant.subject.is_some() {
                    refuse("subject", "is not allowed for sms templates".into());
                }
                if variant.html.is_some() {
                    refuse("html", "is not allowed for sms templates".into());
                }
                if let Some(text) = &variant.text
                    && text.chars().count() > MAX_SMS_CHARS
                {
                    refuse(
                        "text",
                        format!("must be at most {MAX_SMS_CHARS} characters"),
                    );
                }
            }
            Channel::Email => {
                match variant.subject.as_deref() {
                    None => refuse("subject", "is required".into()),
                    Some(s) if s.trim().is_empty() => {
                        refuse("subject", "must not be empty".into());
                    }
                    Some(s) if s.chars().count() > MAX_SUBJECT_CHARS => refuse(
                        "subject",
                        format!("must be at most {MAX_SUBJECT_CHARS} characters"),
                    ),
                    Some(s) if s.contains(['\r', '\n']) => {
                        refuse("subject", "must not contain line breaks".into());
                    }
                    Some(s) => parse("subject", s, &mut refuse),
                }
                for (field, part) in [("text", &variant.text), ("html", &variant.html)] {
                    if let Some(part) = part
                        && part.len() > MAX_EMAIL_PART_BYTES
                    {
                        refuse(
                            field,
                            format!("must be at most {MAX_EMAIL_PART_BYTES} bytes"),
                        );
                    }
                }
                if let Some(html) = &variant.html {
                    parse("html", html, &mut refuse);
                }
            }
        }
    }

    /// The placeholders of every variant together: the names a send may
    /// give.
    pub fn placeholders(&self) -> BTreeSet<String> {
        std::iter::once(self.default_variant())
            .chain(self.locales.values().cloned())
            .flat_map(|variant| variant_names(&variant))
            .collect()
    }

    /// The variant `locale` takes: its own, its language's, then the
    /// default; with the locale variant's name.
    pub fn variant_for(&self, locale: Option<&str>) -> (Option<String>, Variant) {
        let mut wanted = locale.map(str::to_owned);
        while let Some(tag) = wanted {
            if let Some((name, variant)) = self
                .locales
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(&tag))
            {
                return (Some(name.clone()), variant.clone());
            }
            wanted = tag.rsplit_once('-').map(|(shorter, _)| shorter.to_owned());
        }
        (None, self.default_variant())
    }

    /// The template filled for `locale` with `values`; a placeholder of
    /// the variant without a value, a value the template has no
    /// placeholder for, or a result over the channel's bounds is refused,
    /// named under `personalisation`.
    pub fn render(
        &self,
        locale: Option<&str>,
        values: &BTreeMap<String, String>,
    ) -> Result<Rendered, Errors> {
        let mut errors = Errors::new();
        let (locale, variant) = self.variant_for(locale);
        let known = self.placeholders();
        for name in values.keys() {
            if !known.contains(name) {
                errors.insert(
                    format!("personalisation.{}", crate::message::field_name(name)),
                    "is not a placeholder of the template".into(),
                );
            }
        }
        for name in variant_names(&variant) {
            if !values.contains_key(&name) {
                errors.insert(
                    format!("personalisation.{name}"),
                    "is a placeholder of the template and must be given".into(),
                );
            }
        }
        if let Some(subject) = &variant.subject {
            for name in placeholders::names(subject) {
                if values.get(&name).is_some_and(|v| v.contains(['\r', '\n'])) {
                    errors.insert(
                        format!("personalisation.{name}"),
                        "is used in the subject and must not contain line breaks".into(),
                    );
                }
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        // Bounded before it is built: the sizes the parts will have,
        // from the template's pieces and the values' lengths.
        let planned = |part: &Option<String>, escape, unit| {
            part.as_deref()
                .map(|part| placeholders::filled_len(part, values, escape, unit))
        };
        Sizes {
            subject_chars: planned(&variant.subject, Escape::None, Unit::Chars),
            text_chars: planned(&variant.text, Escape::None, Unit::Chars).unwrap_or(0),
            text: planned(&variant.text, Escape::None, Unit::Bytes).unwrap_or(0),
            html: planned(&variant.html, Escape::Html, Unit::Bytes).unwrap_or(0),
        }
        .check(self.channel)?;
        let mut rendered = Rendered {
            locale,
            subject: variant
                .subject
                .as_deref()
                .map(|s| placeholders::fill(s, values, Escape::None)),
            text: String::new(),
            html: variant
                .html
                .as_deref()
                .map(|h| placeholders::fill(h, values, Escape::Html)),
        };
        rendered.text = match (&variant.text, &rendered.html) {
            (Some(text), _) => placeholders::fill(text, values, Escape::None),
            // An email's text alternative, derived from its rendered HTML.
            (None, Some(html)) => crate::message::text_of_html(html),
            (None, None) => String::new(),
        };
        // Measured again as built: a text derived from the HTML is known
        // only now.
        Sizes::of(&rendered).check(self.channel).map(|()| rendered)
    }
}

/// The placeholders of one variant's parts.
fn variant_names(variant: &Variant) -> BTreeSet<String> {
    [&variant.subject, &variant.text, &variant.html]
        .into_iter()
        .flatten()
        .flat_map(|part| placeholders::names(part))
        .collect()
}

/// The sizes of a rendered template's parts, planned or as built.
struct Sizes {
    subject_chars: Option<usize>,
    text_chars: usize,
    /// Bytes of the text and of the HTML part.
    text: usize,
    html: usize,
}

impl Sizes {
    fn of(rendered: &Rendered) -> Self {
        Sizes {
            subject_chars: rendered.subject.as_ref().map(|s| s.chars().count()),
            text_chars: rendered.text.chars().count(),
            text: rendered.text.len(),
            html: rendered.html.as_ref().map_or(0, String::len),
        }
    }

    /// The send's bounds, on what the personalisation makes of the template.
    fn check(&self, channel: Channel) -> Result<(), Errors> {
        let too_long = |what: &str, size: usize, limit: usize, unit: &str| {
            Err(Errors::from([(
                "personalisation".to_owned(),
                format!("makes the {what} {size} {unit}; the most is {limit}"),
            )]))
        };
        match channel {
            Channel::Sms => {
                if self.text_chars > MAX_SMS_CHARS {
                    return too_long("text", self.text_chars, MAX_SMS_CHARS, "characters");
                }
            }
            Channel::Email => {
                if let Some(chars) = self.subject_chars
                    && chars > MAX_SUBJECT_CHARS
                {
                    return too_long("subject", chars, MAX_SUBJECT_CHARS, "characters");
                }
                for (part, size) in [("text", self.text), ("html", self.html)] {
                    if size > MAX_EMAIL_PART_BYTES {
                        return too_long(part, size, MAX_EMAIL_PART_BYTES, "bytes");
                    }
                }
                let body = self.text.saturating_add(self.html);
                if body > MAX_EMAIL_BODY_BYTES {
                    return too_long(
                        "text and html together",
                        body,
                        MAX_EMAIL_BODY_BYTES,
                        "bytes",
                    );
                }
            }
        }
        Ok(())
    }
}

/// A version of a template, as the cache holds it.
#[derive(Debug, Clone)]
pub struct Version {
    pub number: u32,
    pub content: Arc<TemplateContent>,
}

/// The templates' versions, read through a cache; one per instance.
pub struct Templates {
    db: Db,
    latest: Mutex<HashMap<(String, String), (Instant, Version)>>,
    versions: Mutex<HashMap<(String, String, u32), Arc<TemplateContent>>>,
}

impl Templates {
    pub fn new(db: Db) -> Self {
        Templates {
            db,
            latest: Mutex::default(),
            versions: Mutex::default(),
        }
    }

    /// `tenant_id`'s template `id` at `version` (none: its newest), for a
    /// send; none when the template is not there (or deleted) or has no
    /// such version.
    pub async fn for_send(
        &self,
        tenant_id: &str,
        id: &str,
        version: Option<u32>,
    ) -> StoreResult<Option<Version>> {
        let key = (tenant_id.to_owned(), id.to_owned());
        if version.is_none() {
            let latest = self.latest.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((read, found)) = latest.get(&key)
                && read.elapsed() < LATEST_FOR
            {
                return Ok(Some(found.clone()));
            }
        }
        let Some((row, stored)) = self.db.template(tenant_id, id, version).await? else {
            return Ok(None);
        };
        let found = Version {
            number: stored.version,
            content: Arc::new(parse(&stored.body)?),
        };
        if version.is_none() || version == Some(row.version) {
            let mut latest = self.latest.lock().unwrap_or_else(PoisonError::into_inner);
            if latest.len() >= CACHED_VERSIONS {
                latest.clear();
            }
            latest.insert(key, (Instant::now(), found.clone()));
        }
        Ok(Some(found))
    }

    /// One version, deleted template or not: what a queued message is
    /// rendered from at delivery.
    pub async fn version(
        &self,
        tenant_id: &str,
        id: &str,
        version: u32,
    ) -> StoreResult<Option<Arc<TemplateContent>>> {
        let key = (tenant_id.to_owned(), id.to_owned(), version);
        if let Some(found) = self
            .versions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return Ok(Some(Arc::clone(found)));
        }
        let Some(stored) = self.db.template_version(tenant_id, id, version).await? else {
            return Ok(None);
        };
        let content = Arc::new(parse(&stored.body)?);
        let mut versions = self.versions.lock().unwrap_or_else(PoisonError::into_inner);
        if versions.len() >= CACHED_VERSIONS {
            versions.clear();
        }
        versions.insert(key, Arc::clone(&content));
        Ok(Some(content))
    }

    /// Forgets the newest version read of a template this instance just
    /// changed, so its next send uses the change at once.
    pub fn forget(&self, tenant_id: &str, id: &str) {
        self.latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(tenant_id.to_owned(), id.to_owned()));
    }
}

/// A stored version's content.
pub fn parse(body: &str) -> anyhow::Result<TemplateContent> {
    serde_json::from_str(body)
        .map_err(|err| anyhow::anyhow!("a stored template version is not readable: {err}"))
}

#[cfg(test)]
mod tests {
    use super::placeholders::tests::values;
    use super::*;

    fn email() -> TemplateContent {
        TemplateContent {
            name: "welcome".into(),
            channel: Channel::Email,
            priority: Some(Priority::High),
            lane: None,
            subject: Some("Welcome, ((name))".into()),
            text: Some("Hello ((name)), your code is ((code)).".into()),
            html: Some("<p>Hello <b>((name))</b></p>".into()),
            locales: BTreeMap::from([(
                "fr".to_owned(),
                Variant {
                    subject: Some("Bienvenue, ((name))".into()),
                    text: Some("Bonjour ((name)), code ((code)).".into()),
                    html: None,
                },
            )]),
        }
    }

    #[test]
    fn a_locale_falls_back_to_its_language_then_to_the_default() {
        let template = email();
        assert_eq!(template.variant_for(Some("fr-CA")).0.as_deref(), Some("fr"));
        assert_eq!(template.variant_for(Some("FR")).0.as_deref(), Some("fr"));
        assert_eq!(template.variant_for(Some("de-AT")).0, None);
        assert_eq!(template.variant_for(None).0, None);
    }

    #[test]
    fn rendering_fills_every_part_and_escapes_only_the_html() {
        let rendered = email()
            .render(None, &values(&[("name", "<Ann>"), ("code", "42")]))
            .unwrap();
        assert_eq!(rendered.subject.as_deref(), Some("Welcome, <Ann>"));
        assert_eq!(rendered.text, "Hello <Ann>, your code is 42.");
        assert_eq!(
            rendered.html.as_deref(),
            Some("<p>Hello <b>&lt;Ann&gt;</b></p>")
        );
    }

    #[test]
    fn missing_unknown_and_subject_breaking_values_are_named() {
        let errors = email()
            .render(None, &values(&[("name", "a\nb"), ("nope", "x")]))
            .unwrap_err();
        assert!(errors.contains_key("personalisation.code"), "{errors:?}");
        assert!(errors.contains_key("personalisation.nope"), "{errors:?}");
        assert!(errors["personalisation.name"].contains("line breaks"));
    }

    #[test]
    fn a_rendered_sms_over_its_bound_is_refused() {
        let sms = TemplateContent {
            name: "code".into(),
            channel: Channel::Sms,
            priority: None,
            lane: None,
            subject: None,
            text: Some("((x))".into()),
            html: None,
            locales: BTreeMap::new(),
        };
        sms.check().unwrap();
        let long = "y".repeat(MAX_SMS_CHARS + 1);
        let errors = sms.render(None, &values(&[("x", &long)])).unwrap_err();
        assert!(errors["personalisation"].contains("1601"), "{errors:?}");
    }

    #[test]
    fn a_template_is_checked_part_by_part_and_locale_by_locale() {
        let mut template = email();
        template.check().unwrap();
        template.subject = None;
        template.locales.insert(
            "fr-ca".into(),
            Variant {
                subject: Some("S".into()),
                text: Some("((open".into()),
                html: None,
            },
        );
        template.locales.insert("x".into(), Variant::default());
        let errors = template.check().unwrap_err();
        assert_eq!(errors["subject"], "is required");
        assert!(errors.contains_key("locales.fr-ca.text"), "{errors:?}");
        assert!(errors.contains_key("locales.x"), "{errors:?}");
        let mut sms = email();
        sms.channel = Channel::Sms;
        let errors = sms.check().unwrap_err();
        assert!(errors.contains_key("subject") && errors.contains_key("html"));
    }

    #[test]
    fn an_email_template_with_html_only_gets_a_text_derived_from_the_rendered_html() {
        let mut template = email();
        template.text = None;
        template.locales.clear();
        template.check().unwrap();
        let rendered = template
            .render(None, &values(&[("name", "Ann & Bo")]))
            .unwrap();
        assert!(rendered.text.contains("Hello"), "{}", rendered.text);
        assert!(rendered.text.contains("Ann & Bo"), "{}", rendered.text);
        assert!(!rendered.text.contains('<'), "{}", rendered.text);
        let mut sms = email();
        sms.channel = Channel::Sms;
        sms.text = None;
        assert_eq!(sms.check().unwrap_err()["text"], "is required");
    }

    #[test]
    fn locales_are_language_then_subtags() {
        for good in ["fr", "fr-CA", "zh-Hant-TW", "es-419"] {
            assert!(is_locale(good), "{good}");
        }
        for bad in ["", "f", "french", "fr_CA", "fr-", "fr-C"] {
            assert!(!is_locale(bad), "{bad}");
        }
    }
}
