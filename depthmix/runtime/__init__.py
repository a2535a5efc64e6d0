"""The process a command runs in: its launcher environment, console/log stream and the patches entry points install (CPU shim, library quirks)."""
