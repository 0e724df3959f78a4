"""rtrl: command line, settings and the lifecycle job that ties the packages together.

The packages themselves live beside this one: ``policy`` (the model artifact), ``offline_rl``
(simulated GRPO up to the quality gate), ``serving`` (the gateway) and ``realtime_rl`` (events,
feedback tables, single-rollout updates, releases).
"""

__version__ = "0.1.0"
