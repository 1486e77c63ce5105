"""POSIX-like front ends: file objects, open()/os interception, FUSE."""
