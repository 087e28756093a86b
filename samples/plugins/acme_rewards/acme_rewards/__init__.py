"""ACME's loraplex plug-ins (a sample)."""
