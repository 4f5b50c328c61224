"""sim layer of ddiloco (see docs/ and DESIGN.md)."""
