"""Keep your script: skylift's spot survival, resume, metrics, cost and report for
training loops that a framework owns.

- :mod:`skylift.integrations.transformers`: ``SkyliftCallback`` for a Hugging Face
  ``Trainer`` and ``resume_checkpoint`` for ``trainer.train(resume_from_checkpoint=...)``.
- :mod:`skylift.integrations.lightning`: the same for a Lightning ``Trainer``
  (``ckpt_path=...``).

Each imports its framework, so import the one your script uses; ``import skylift``
imports neither. The shared parts: :mod:`~skylift.integrations.run` (the services of
one attempt), :mod:`~skylift.integrations.checkpoints` (a framework's folders sealed
with skylift's manifest, mirrored and restored) and :mod:`~skylift.integrations.commit`
(where checkpoints live, the commit, the resume choice).
"""
