"""Plug-ins for loraplex's engine tests: well-behaved ones and hostile ones."""
