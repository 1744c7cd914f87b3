"""Distributed reinforcement learning: one agent, several observers, REINFORCE, on MPI.

The shape of the REINFORCE part of PyTorch's tutorial "Getting Started with Distributed RPC
Framework": the agent on rank 0 holds the policy; every other rank hosts an observer,
created by the agent with ``rpc.remote``, which owns an environment. For each episode the
agent asks every observer at once to play it (``ob_rref.rpc_async().run_episode(...)``);
an observer calls the agent back for every action (``agent_rref.rpc_sync().select_action``)
and reports every reward. When all observers are done, the agent updates the policy with
REINFORCE, locally: the log-probabilities it saved while choosing actions are ordinary
local autograd tensors, no distributed autograd is needed.

Instead of gym's CartPole, each observer owns a tiny environment written below in pure
torch, ``MoveToTarget``: a point on a line must reach a target by stepping left or right,
and every step is rewarded by the progress it made. A random policy wanders (a total reward
near 0 per episode), a good one walks straight to the target (about +6 on average). The
run checks that the policy learned: it moves towards the target more often than before
(measured on a fixed grid of states) and, over 20 episodes or more, earns more reward.

Run:  python -m mpidag.run -n 3 examples/rl_agent.py [--episodes 40] [--max-steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import threading
from dataclasses import dataclass

import torch
from torch import nn, optim
from torch.distributions import Categorical

import mpidag.rpc as rpc  # was: import torch.distributed.rpc as rpc
from mpidag.rpc import RRef  # was: from torch.distributed.rpc import RRef

AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"
GAMMA = 0.9
LR = 3e-2


# -------------------------------------------------------------------- environment
class MoveToTarget:
    """A 1-D world: reach the target by moving left (action 0) or right (action 1).

    The state is ``(position, target)``, both drawn in [-1, 1] at ``reset``. A step moves
    by 0.1 and is rewarded by the progress it made, in steps: +1 towards the target, -1
    away from it. The episode ends within one step of the target.
    """

    STEP = 0.1

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0.0
        self.target = 0.0

    def reset(self) -> torch.Tensor:
        self.position, self.target = (torch.rand(2, generator=self.generator) * 2 - 1).tolist()
        return self.state()

    def state(self) -> torch.Tensor:
        return torch.tensor([self.position, self.target])

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        before = abs(self.target - self.position)
        move = self.STEP if action == 1 else -self.STEP
        self.position = max(-1.5, min(1.5, self.position + move))
        after = abs(self.target - self.position)
        return self.state(), (before - after) / self.STEP, after <= self.STEP


# ------------------------------------------------------------------------- policy
class Policy(nn.Module):
    """(position, target) -> probabilities of (left, right)."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(2, 32)
        self.affine2 = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.affine2(torch.tanh(self.affine1(x))), dim=-1)


# ----------------------------------------------------------------------- observer
class Observer:
    """Lives on an observer rank (made there by the agent's ``rpc.remote``)."""

    def __init__(self) -> None:
        self.id = rpc.get_worker_info().id
        self.env = MoveToTarget(seed=self.id)

    def run_episode(self, agent_rref: RRef, n_steps: int) -> None:
        """Play one episode, asking the agent for every action (RPCs back to rank 0)."""
        state = self.env.reset()
        for _ in range(n_steps):
            # The policy lives on the agent: run select_action there and wait.
            action = agent_rref.rpc_sync().select_action(self.id, state)
            state, reward, done = self.env.step(action)
            agent_rref.rpc_sync().report_reward(self.id, reward)
            if done:
                break


# -------------------------------------------------------------------------- agent
class Agent:
    """Lives on rank 0: the policy, one observer per other rank, the REINFORCE update."""

    def __init__(self, world_size: int) -> None:
        torch.manual_seed(0)
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=LR)
        self.agent_rref = RRef(self)  # handed to the observers, which call us back
        self.ob_rrefs: list[RRef] = []
        self.rewards: dict[int, list[float]] = {}
        self.saved_log_probs: dict[int, list[torch.Tensor]] = {}
        self.lock = threading.Lock()  # observers call select_action concurrently
        self.running_reward = 0.0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            # Create an Observer on that rank; keep a remote reference to it.
            self.ob_rrefs.append(rpc.remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id: int, state: torch.Tensor) -> int:
        """Called by observer ``ob_id`` over RPC; records the log-probability for later."""
        probs = self.policy(state.unsqueeze(0))
        m = Categorical(probs)
        action = m.sample()
        with self.lock:
            self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id: int, reward: float) -> None:
        with self.lock:
            self.rewards[ob_id].append(reward)

    @torch.no_grad()
    def toward_target_probability(self) -> float:
        """How likely the policy moves towards the target, over a fixed grid of states.

        A measure of the policy alone, free of the luck of the episodes: about 0.5 for a
        random policy, near 1 for a good one.
        """
        position, target = torch.meshgrid(torch.linspace(-1, 1, 21),
                                          torch.linspace(-1, 1, 21), indexing="ij")
        apart = (position - target).abs() > MoveToTarget.STEP
        states = torch.stack([position[apart], target[apart]], dim=1)
        right = (states[:, 1] > states[:, 0]).long()  # action 1 moves right
        return self.policy(states).gather(1, right[:, None]).mean().item()

    def run_episode(self, n_steps: int) -> None:
        """Every observer plays one episode, all at the same time."""
        futs = [ob_rref.rpc_async().run_episode(self.agent_rref, n_steps)
                for ob_rref in self.ob_rrefs]
        for fut in futs:
            fut.wait()

    def finish_episode(self) -> float:
        """REINFORCE on the episodes just played; returns their mean total reward."""
        log_probs: list[torch.Tensor] = []
        returns: list[float] = []
        totals = []
        for ob_id, rewards in self.rewards.items():
            totals.append(sum(rewards))
            episode_returns, ret = [], 0.0
            for r in reversed(rewards):  # discounted returns, per observer's episode
                ret = r + GAMMA * ret
                episode_returns.insert(0, ret)
            returns.extend(episode_returns)
            log_probs.extend(self.saved_log_probs[ob_id])
        # REINFORCE: raise the log-probability of each action by its return. A random
        # policy's rewards average 0 here, so the returns need no baseline (the tutorial
        # normalizes them, which on a single episode of bad moves would praise half of them).
        loss = -(torch.cat(log_probs) * torch.tensor(returns)).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        episode_reward = statistics.mean(totals)
        self.running_reward = 0.1 * episode_reward + 0.9 * self.running_reward
        return episode_reward


@dataclass
class TrainingResult:
    rewards: list[float]  # mean total reward of the observers' episodes, per episode
    toward_before: float  # toward_target_probability() before and after training
    toward_after: float


def run_agent(world_size: int, episodes: int, max_steps: int, log_interval: int
              ) -> TrainingResult:
    agent = Agent(world_size)
    toward_before = agent.toward_target_probability()
    rewards: list[float] = []
    for i_episode in range(1, episodes + 1):
        agent.run_episode(n_steps=max_steps)
        rewards.append(agent.finish_episode())
        if i_episode == 1:
            agent.running_reward = rewards[0]
        if i_episode % log_interval == 0 or i_episode == 1:
            print(f"[agent] episode {i_episode:3d}  last reward {rewards[-1]:6.2f}  "
                  f"running reward {agent.running_reward:6.2f}", flush=True)
    result = TrainingResult(rewards, toward_before, agent.toward_target_probability())
    # Drop the RRefs to the observers and to the agent itself before shutting down.
    agent.ob_rrefs.clear()
    agent.agent_rref = None
    return result


def summarize(world_size: int, result: TrainingResult) -> None:
    """Check that the agent learned (exit non-zero if not) and print the OK line.

    Always checked: the policy moves towards the target more often than before. With 20
    episodes or more, also the episode rewards (in shorter runs their luck dominates).
    """
    rewards = result.rewards
    window = max(1, min(10, len(rewards) // 4))
    first = statistics.mean(rewards[:window])
    last = statistics.mean(rewards[-window:])
    print(f"[agent] probability of moving towards the target: {result.toward_before:.2f} -> "
          f"{result.toward_after:.2f}", flush=True)
    problems = []
    if not result.toward_after > result.toward_before:
        problems.append(f"probability of moving towards the target {result.toward_before:.2f}"
                        f" -> {result.toward_after:.2f}")
    if len(rewards) >= 20 and not last > first:
        problems.append(f"mean reward of the first {window} episodes {first:.2f}, of the "
                        f"last {window} {last:.2f}")
    if problems:
        raise SystemExit(f"FAIL rl_agent: the agent did not improve: {'; '.join(problems)}")
    print(f"OK rl_agent: world_size={world_size} observers={world_size - 1} "
          f"episodes={len(rewards)} reward {first:.2f} -> {last:.2f} (mean episode reward, "
          f"first {window} -> last {window} episodes) toward_target "
          f"{result.toward_before:.2f} -> {result.toward_after:.2f}", flush=True)


def run_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    if rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        result = run_agent(world_size, args.episodes, args.max_steps, args.log_interval)
        rpc.shutdown()  # blocks until every worker is done
        summarize(world_size, result)
    else:
        # Observers only serve: the agent drives them through RPCs.
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
        rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=40, help="episodes per observer")
    parser.add_argument("--max-steps", type=int, default=20, help="steps per episode, at most")
    parser.add_argument("--log-interval", type=int, default=10, help="episodes between logs")
    args = parser.parse_args()
    if args.episodes < 1 or args.max_steps < 1 or args.log_interval < 1:
        parser.error("need --episodes >= 1, --max-steps >= 1 and --log-interval >= 1")

    from mpi4py import MPI  # MPI gives each process its rank (torch: mp.spawn)

    rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if world_size < 2:
        raise SystemExit("rl_agent needs at least 2 ranks: 1 agent + observers "
                         "(python -m mpidag.run -n 3 examples/rl_agent.py)")
    run_worker(rank, world_size, args)


if __name__ == "__main__":
    main()
