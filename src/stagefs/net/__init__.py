"""The peer protocol (sans-I/O framing), its authentication, server and client pool."""
