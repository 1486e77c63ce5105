"""POSIX-like front ends: open()/os interception and FUSE, over the Store's file objects."""
