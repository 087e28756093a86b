"""Multi-turn environments behind one interface of our own (base.py): an episode starts
from a task's prompt and answer, the policy acts in turns, the environment answers each
turn with an observation (a tool's output, feedback) and a reward, until it is done or a
bound ends it. Adapters take what the field shares (skyrl.py: skyrl-gym's text
environments); episodes.py drives many experiments' episodes in one rollout batch per
turn. The plug-in worker (worker.py, a child process per experiment) and attaching an
experiment's plug-ins (attach.py) live here too: they run environments. Kept free of
imports: the plug-in worker imports base.py and skyrl.py alone.
"""
