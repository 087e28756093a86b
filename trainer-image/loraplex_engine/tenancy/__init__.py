"""Tenants kept apart: trust and egress, data files, reward exchanges, work limits,
admissions. Sharing the tick between them is tick/fair_share.py's and tick/time_share.py's."""
