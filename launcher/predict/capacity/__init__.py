"""Capacity: how many GPUs serve a load (the M/G/c queue), the GPU-kind mix, and the price book.
"""
