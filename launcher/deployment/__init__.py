"""The deployment plan: typed objects (plan.py), their one JSON form (codec.py), the engine's
argv (argv.py) and the JSON Schema generated from the types (schema.py). A stage between
inputs and predict: the planner builds a Deployment, every later stage reads one."""
