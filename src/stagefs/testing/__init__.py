"""Test suites shipped with stagefs, for users extending it (holders.py: every ShardSource)."""
