"""What vlaunch is given: the GPUs (catalog, NVML), the model (config, tensors), the workload and
SLO.
"""
