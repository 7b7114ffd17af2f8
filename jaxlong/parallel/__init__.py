"""Context-parallel attention: Ulysses (`ulysses`), U-Pipe (`upipe`) and ring attention (`ring`)."""
