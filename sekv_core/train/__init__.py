"""Training the zoom-in router with the base model frozen (`sekv train`).

The router (:mod:`sekv_core.zoom.zoomnet`) learns to reproduce what the frozen full-KV model attends
to, on documents generated in code. One idea per module:

- :mod:`.data` (with :mod:`.facts`, :mod:`.prose`, :mod:`.reports`): the generated corpus;
- :mod:`.teacher`: the full-KV model's signals (answer log-probs, span attention mass, targets);
- :mod:`.student`: the differentiable gated zoom attention, decision by decision as answering;
- :mod:`.examples`: documents prepared to train on (stores, span K/V, teacher signals);
- :mod:`.losses`: the objective; :mod:`.evaluate`: held-out figures and model selection;
- :mod:`.checkpoint`: router file + optimizer state on disk; :mod:`.loop`: the training loop;
- :mod:`.settings`: :class:`~.settings.TrainSettings`.
"""
