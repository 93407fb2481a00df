"""Ridgeline agent: the daemon, the CLI and the consumers of the record stream."""
