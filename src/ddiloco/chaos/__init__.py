"""chaos layer of ddiloco: fault plans, injectors, analysis (docs/chaos.md)."""
