"""The simulator's time: one step-time model for a training run and for plan mode.

=======================  ===================================================================
module                   holds
=======================  ===================================================================
``clock``                ``VirtualClock``: one rank's compute and communication streams
``step``                 ``StepModel``: the device time of one step from what ran in it
                         (kernel costs, collectives, the overlap rules); the run's virtual
                         clock and ``python -m simdist.plan`` both call it
``dp_schedule``          the step events data parallelism / ZeRO 0-2 implies for a model's
                         shapes (what the run records, predicted), for plan mode
``pp_schedule``          a pipeline's step (schedule, stage syncs, update) and memory per
                         rank: the pipeline run's estimate and trace, and plan mode's
``rank``                 the run side: the device of a rank, the recording hooks, the
                         per-run report (critical path, performance.json, timeline)
``plan``                 plan mode (``python -m simdist.plan``): memory and step time from
                         shapes; a configuration simdist runs goes through ``step``
``plan_shapes``          plan mode's model shapes (YAML files, ``simdist/models/shapes``)
                         and closed-form memory formulas
``plan_analytic``        plan mode's Megatron / DDP schedule for what simdist does not run
``search``               plan mode's search over layouts (``--search``) and scaling table
=======================  ===================================================================

Per-kernel and per-collective costs, profiles and memory live in ``simdist.device``. No
module here imports the run (``simdist.run``, ``simdist.streaming``, ...): what a run
provides is passed in as arguments.
"""
