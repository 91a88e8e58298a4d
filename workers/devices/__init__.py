"""Where instances run and how their data gets there: Triton's `instance_group` placement on
the GPUs a worker sees (`placement`), a CUDA lane's pinned buffers and stream (`cuda_staging`),
the next batch's inputs copied while the lane computes (`stage_ahead`), and the GPU and CPU
figures the fleet reports (`device_sampler`).
"""
