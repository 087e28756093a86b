"""One step of every experiment: the tick (tick/tick.py), its pipelined form, its
results, and how ticks are shared between tenants (tick/fair_share.py, tick/time_share.py)."""
