"""Tenants kept apart: trust and egress, fair share, work limits."""
