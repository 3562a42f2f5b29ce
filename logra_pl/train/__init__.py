"""One policy update: sampling and scoring, the trainer's passes, batching, the backward, shaping, the asynchronous
pipeline, the engine link, the reference policy, validation metrics, the warm start and the step's settings."""
