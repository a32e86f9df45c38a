"""miles subpackage."""
