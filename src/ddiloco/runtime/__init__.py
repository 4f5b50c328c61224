"""runtime layer of ddiloco: processes, supervision, launchers (docs/runtime.md, docs/architecture.md)."""
