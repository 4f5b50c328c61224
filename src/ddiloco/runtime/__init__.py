"""runtime layer of ddiloco (see docs/ and DESIGN.md)."""
