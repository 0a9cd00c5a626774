# shellcheck shell=bash
# SITE-SPECIFIC settings for the Slurm scripts: copy this file, keep what your cluster
# needs, and point SITE_ENV at the copy (`export SITE_ENV=$HOME/site_env.sh`). It is
# sourced by the batch shell before the launch, so everything exported here reaches
# every node through srun. Nothing in it is right everywhere, so nothing is enabled.

# Software environment.
# module load cuda/12.4 nccl/2.21
# export VENV=/shared/envs/megatron_lev        # or: source /shared/conda/bin/activate lev

# NCCL network. Ask your admins, or read `ibv_devinfo` / `ip -br addr` on a node.
# export NCCL_SOCKET_IFNAME=ib0                # interface for NCCL's bootstrap (never lo/docker)
# export GLOO_SOCKET_IFNAME=ib0                # same, for gloo (rendezvous, CPU groups)
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3  # InfiniBand adapters to use
# export NCCL_IB_GID_INDEX=3                   # RoCE clusters
# export NCCL_NET_GDR_LEVEL=PHB                # GPUDirect RDMA reach
# export NCCL_CROSS_NIC=1

# AWS (EFA):
# export FI_PROVIDER=efa
# export FI_EFA_USE_DEVICE_RDMA=1
# export NCCL_PROTO=simple

# Debugging a hang or a slow all-reduce:
# export NCCL_DEBUG=INFO
# export NCCL_DEBUG_SUBSYS=INIT,NET
# export TORCH_DISTRIBUTED_DEBUG=DETAIL
