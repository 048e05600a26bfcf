"""A fleet of replicas on a virtual clock: each runs our own Scheduler and KVCacheManager (only
the model's forward pass is replaced, by a step-time model), the routers are our own ranking code
(router/ranking.py) and Serve's baselines. Torch-free and deterministic per seed: it sizes fleets
and shows how routing behaves at 4-64 replicas, which one machine cannot run for real."""
