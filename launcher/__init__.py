"""vlaunch: plan, start and watch vLLM deployments.

Data flows one way: inventory + model -> plan -> runner / exporter. The planner path
(`vlaunch plan`) imports neither torch, vllm, transformers nor numpy, so it stays light
enough for a Kubernetes init container.
"""

__version__ = "0.1.0"
