//! Email addresses as the providers take them. SES v2 takes 7-bit ASCII
//! addresses, the domain in Punycode (IDNA), and no internationalised
//! local part (SMTPUTF8): an address with a non-ASCII domain is converted
//! at accept, with the `idna` crate (UTS #46, as browsers and mail clients
//! do), and one with a non-ASCII local part is refused.

/// Why an address cannot go to the provider as it is given.
pub const LOCAL_PART_NOT_ASCII: &str = "has non-ASCII characters before the @: the email provider (SES) takes only ASCII there (no SMTPUTF8); a non-ASCII domain is fine";
/// The domain has no IDNA form.
pub const DOMAIN_NOT_IDNA: &str = "has a domain that is not a valid internationalised domain name";

/// `address` (a syntactically valid email address) as the provider takes
/// it: its domain in ASCII (Punycode for an internationalised domain,
/// lower-cased by IDNA's mapping), its local part unchanged; an ASCII
/// address comes back as it is. `Err` says why the address cannot be sent.
pub fn ascii_address(address: &str) -> Result<String, &'static str> {
    let Some((local, domain)) = address.rsplit_once('@') else {
        return Ok(address.to_owned());
    };
    if !local.is_ascii() {
        return Err(LOCAL_PART_NOT_ASCII);
    }
    if domain.is_ascii() {
        return Ok(address.to_owned());
    }
    let ascii = idna::domain_to_ascii(domain).map_err(|_| DOMAIN_NOT_IDNA)?;
    if ascii.is_empty() || !ascii.is_ascii() {
        return Err(DOMAIN_NOT_IDNA);
    }
    Ok(format!("{local}@{ascii}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_internationalised_domain_is_sent_in_punycode() {
        assert_eq!(
            ascii_address("user@bücher.example").unwrap(),
            "user@xn--bcher-kva.example"
        );
        assert_eq!(
            ascii_address("Ada@BÜCHER.example").unwrap(),
            "Ada@xn--bcher-kva.example",
            "IDNA maps the domain to lower case; the local part stays as given"
        );
        assert_eq!(ascii_address("ada@example.com").unwrap(), "ada@example.com");
    }

    #[test]
    fn a_non_ascii_local_part_is_refused() {
        assert_eq!(ascii_address("üser@example.com"), Err(LOCAL_PART_NOT_ASCII));
    }
}
