"""Many models in one server: the on-demand models beside the base model (``--model NAME=PATH``, ``--models-dir``).

    policy.py   which models stay resident (load / evict / idle unload), over numbers only
    pool.py     the mechanism: entries, leases, one loader thread per load, the idle sweeper
    flags.py    --model as given: the base model and the named ones
    build.py    the pool and the alias rules from the command line
"""
