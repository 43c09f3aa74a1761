"""Offloaded execution of the target model: placement, weight streaming, the two-batch pipeline, tracing."""
