//! How many fragments (billed segments) an SMS text takes.
//!
//! A text made only of the GSM 03.38 default alphabet is sent in GSM-7:
//! 160 septets in one message, or 153 per part once it is split (each part
//! carries a header). The alphabet's extension table (`^ { } \ [ ~ ] | €`
//! and form feed) takes two septets each (an escape, then the character),
//! and a part never ends between the two. One character outside both tables
//! sends the whole text as UCS-2: 70 UTF-16 units in one message, 67 per
//! part, where a character outside the Basic Multilingual Plane (most emoji)
//! takes two units that are never split between parts either.

/// Septets `c` takes in GSM-7, or `None` when it is not in GSM 03.38: one
/// for the default alphabet, two for its extension table (an escape, then
/// the character). A `match`, so counting a text is one pass with no
/// lookup per character (this runs on the accept path).
fn gsm_septets(c: char) -> Option<u32> {
    match c {
        'A'..='Z' | 'a'..='z' | '0'..='9' => Some(1),
        ' ' | '!' | '"' | '#' | '$' | '%' | '&' | '\'' | '(' | ')' | '*' | '+' | ',' | '-'
        | '.' | '/' | ':' | ';' | '<' | '=' | '>' | '?' | '@' | '_' | '\n' | '\r' => Some(1),
        '£' | '¥' | 'è' | 'é' | 'ù' | 'ì' | 'ò' | 'Ç' | 'Ø' | 'ø' | 'Å' | 'å' | 'Δ' | 'Φ' | 'Γ'
        | 'Λ' | 'Ω' | 'Π' | 'Ψ' | 'Σ' | 'Θ' | 'Ξ' | '\u{1b}' | 'Æ' | 'æ' | 'ß' | 'É' | '¤'
        | '¡' | 'Ä' | 'Ö' | 'Ñ' | 'Ü' | '§' | '¿' | 'ä' | 'ö' | 'ñ' | 'ü' | 'à' => {
            Some(1)
        }
        '\u{0c}' | '^' | '{' | '}' | '\\' | '[' | '~' | ']' | '|' | '€' => Some(2),
        _ => None,
    }
}

/// Parts of `units`, each taking the number of units it gives, packed
/// into parts of `single` units (one part) or `per_part` (several), no
/// item split between two parts.
fn parts(units: &[u32], single: u32, per_part: u32) -> u32 {
    let total: u32 = units.iter().sum();
    if total <= single {
        return 1;
    }
    let (mut count, mut used) = (1, 0);
    for &size in units {
        if used + size > per_part {
            count += 1;
            used = 0;
        }
        used += size;
    }
    count
}

/// The encoding a text is sent in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Gsm7,
    Ucs2,
}

impl Encoding {
    /// `gsm7` or `ucs2`.
    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Gsm7 => "gsm7",
            Encoding::Ucs2 => "ucs2",
        }
    }
}

/// The encoding and the number of fragments of `text` (at least one).
pub fn fragments(text: &str) -> (Encoding, u32) {
    let septets: Option<Vec<u32>> = text.chars().map(gsm_septets).collect();
    match septets {
        Some(septets) => (Encoding::Gsm7, parts(&septets, 160, 153)),
        None => {
            let units: Vec<u32> = text.chars().map(|c| c.len_utf16() as u32).collect();
            (Encoding::Ucs2, parts(&units, 70, 67))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `match` holds exactly the GSM 03.38 tables: the 128 characters
    /// of the default alphabet (as the standard lists them, row by row) and
    /// the 10 of the extension table.
    #[test]
    fn the_alphabet_is_the_standards() {
        let basic = "@£$¥èéùìòÇ\nØø\rÅåΔ_ΦΓΛΩΠΨΣΘΞ\u{1b}ÆæßÉ !\"#¤%&'()*+,-./0123456789:;<=>?\
                     ¡ABCDEFGHIJKLMNOPQRSTUVWXYZÄÖÑÜ§¿abcdefghijklmnopqrstuvwxyzäöñüà";
        assert_eq!(basic.chars().count(), 128);
        for c in basic.chars() {
            assert_eq!(gsm_septets(c), Some(1), "{c:?}");
        }
        for c in "\u{0c}^{}\\[~]|€".chars() {
            assert_eq!(gsm_septets(c), Some(2), "{c:?}");
        }
        let counted = (0..=0x10FFFF)
            .filter_map(char::from_u32)
            .filter(|c| gsm_septets(*c).is_some())
            .count();
        assert_eq!(counted, 138);
    }

    /// Known texts and their segments, as Twilio's segment calculator
    /// counts them (GSM-7 160/153, UCS-2 70/67, escapes and surrogate
    /// pairs kept whole).
    #[test]
    fn fragment_counts_of_known_texts() {
        let a = |n: usize| "a".repeat(n);
        let cases: Vec<(String, Encoding, u32)> = vec![
            (String::new(), Encoding::Gsm7, 1),
            (a(1), Encoding::Gsm7, 1),
            (a(160), Encoding::Gsm7, 1),
            (a(161), Encoding::Gsm7, 2),
            (a(306), Encoding::Gsm7, 2),
            (a(307), Encoding::Gsm7, 3),
            (a(153 * 3), Encoding::Gsm7, 3),
            (a(153 * 3 + 1), Encoding::Gsm7, 4),
            // Extension characters take two septets.
            (format!("{}{{", a(158)), Encoding::Gsm7, 1),
            (format!("{}{{", a(159)), Encoding::Gsm7, 2),
            (format!("{}€", a(158)), Encoding::Gsm7, 1),
            (format!("{}^", a(159)), Encoding::Gsm7, 2),
            ("€".repeat(80), Encoding::Gsm7, 1),
            ("€".repeat(81), Encoding::Gsm7, 2),
            // An escape is not split: 152 septets, then `{` opens part 2.
            (format!("{}{{{}", a(152), a(10)), Encoding::Gsm7, 2),
            (format!("{}{{{}", a(152), a(152)), Encoding::Gsm7, 3),
            // Accented letters of the GSM alphabet stay GSM-7 ...
            ("é".repeat(160), Encoding::Gsm7, 1),
            ("ÄÖÑÜäöñüà".to_owned(), Encoding::Gsm7, 1),
            // ... others switch the whole text to UCS-2.
            ("á".to_owned(), Encoding::Ucs2, 1),
            (format!("{}á", a(69)), Encoding::Ucs2, 1),
            (format!("{}á", a(70)), Encoding::Ucs2, 2),
            (format!("{}ê", a(133)), Encoding::Ucs2, 2),
            (format!("{}ê", a(134)), Encoding::Ucs2, 3),
            // An emoji is two UTF-16 units, never split.
            ("😀".to_owned(), Encoding::Ucs2, 1),
            (format!("{}😀", a(68)), Encoding::Ucs2, 1),
            (format!("{}😀", a(69)), Encoding::Ucs2, 2),
            (format!("{}😀{}", a(66), a(10)), Encoding::Ucs2, 2),
            ("😀".repeat(35), Encoding::Ucs2, 1),
            ("😀".repeat(36), Encoding::Ucs2, 2),
            ("😀".repeat(67), Encoding::Ucs2, 3),
        ];
        for (text, encoding, count) in cases {
            assert_eq!(
                fragments(&text),
                (encoding, count),
                "{} chars: {:?}…",
                text.chars().count(),
                text.chars().take(12).collect::<String>()
            );
        }
    }
}
