"""loraplex-gateway: tenants' one way in (the OpenAI API under /v1, the Tinker API under
/api/v1), in front of every pool's engines (docs/design/gateway.md)."""
