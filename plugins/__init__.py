"""Custom ops (MoE routing and dispatch, absorbed MLA attention), each defined once with every face."""
