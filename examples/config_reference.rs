//! Prints the book's configuration reference, rendered from the config
//! structs and `config/default.toml`:
//!
//! ```sh
//! cargo run --example config_reference > docs/src/reference/configuration.md
//! ```

fn main() {
    print!("{}", fairlane::config_reference::render());
}
