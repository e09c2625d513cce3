"""Developer tools run from a source checkout (not installed with the package): python tools/<name>.py --help."""
