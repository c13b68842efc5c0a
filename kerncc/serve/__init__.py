"""Serving several sequences at once: prefill packing, a scheduler step, a paged KV pool, the
engine loop over a Session or Chain, and the HTTP server in front of it (ARCHITECTURE §9)."""
