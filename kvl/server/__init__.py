"""`kvl serve`: OpenAI- and Anthropic-compatible HTTP APIs over one persistent Engine.

Modules: app (routes, auth, runner), worker (the engine thread and its queue), openai_api and
anthropic_api (the two JSON dialects), errors (error shapes and field checks).
"""
