"""Sub-agents: one more tool, `delegate BRIEF`, served by a layer on top of the agent loop.

    <|call|>delegate Read chapters 1 to 20 and say which mention a fox<|result|>

starts a sub-agent in the same batch: its only user message is the brief (after
its own system text), it works through the caller's toolbox, and its answer
comes back to the caller as the call's result. While it works, the caller
waits parked: its slot is free for the sub-agent, its pages keep its cache.

    batch = subagents.new_batch(params, cfg, tok, fmt, n_prompts=len(prompts), slots=8, max_len=1024)
    records = subagents.run(batch, tok, fmt, prompts, toolboxes, brief_system=fit.INSTRUCTIONS, view=...)
    records[0].subagents     -> the Records of the sub-agents episode 0 started

Limits: a sub-agent cannot delegate (max_depth 1), and an episode of `prompts`
starts at most 8 sub-agents, its sub-agents' own included.
"""

import dataclasses

from minagent import agent, chat

DELEGATE = "delegate"
MAX_DEPTH = 1
MAX_SUBAGENTS = 8


def delegation(call, depth, started, max_depth=MAX_DEPTH, max_subagents=MAX_SUBAGENTS):
    """-> (brief, error): ("B", None) to start a sub-agent on brief B, (None, "error: ...") for a
    delegate call over a limit, (None, None) for any other call (the toolbox's)."""
    parts = call.split(None, 1)     # split as Toolbox splits: "delegate\tRead ch01" -> ["delegate", "Read ch01"]
    if not parts or parts[0] != DELEGATE:
        return None, None
    brief = parts[1] if len(parts) == 2 else ""
    if depth >= max_depth:
        return None, f"error: a sub-agent at depth {depth} cannot delegate (max depth {max_depth})"
    if started >= max_subagents:
        return None, f"error: no more sub-agents, {max_subagents} already started"
    if not brief.strip():
        return None, "error: delegate takes a brief"
    return brief.strip(), None


def subagent_result(record):
    """What the caller of `delegate` reads: the sub-agent's answer, its refusal, or an error."""
    if record.status in ("done", "refused"):
        return record.answer
    return f"error: the sub-agent stopped without an answer ({record.status})"


@dataclasses.dataclass
class Family:
    depth: int                      # 0 for an episode of `prompts`, 1 for its sub-agents, ...
    root: agent.Episode             # the episode of `prompts` it works for
    parent: agent.Episode | None    # the episode waiting for its answer
    subagents: list = dataclasses.field(default_factory=list)   # Records of the sub-agents it started


class SubAgentLoop(agent.Loop):
    """agent.Loop, plus `delegate`: serve() starts a sub-agent and parks the caller; end() answers it."""

    def __init__(self, batch, tok, fmt, *, brief_system=None, max_depth=MAX_DEPTH, max_subagents=MAX_SUBAGENTS,
                 **kw):
        super().__init__(batch, tok, fmt, **kw)
        self.brief_system, self.max_depth, self.max_subagents = brief_system, max_depth, max_subagents
        self.family = {}            # Episode -> Family
        self.started = {}           # root Episode -> sub-agents started for it

    def start(self, prompt, toolbox, system=None, parent=None):
        ep = super().start(prompt, toolbox, system)
        up = self.family.get(parent)
        self.family[ep] = Family(0, ep, None) if up is None else Family(up.depth + 1, up.root, parent)
        self.started.setdefault(self.family[ep].root, 0)
        return ep

    def serve(self, ep, call):
        me = self.family[ep]
        brief, error = delegation(call, me.depth, self.started[me.root], self.max_depth, self.max_subagents)
        if error:
            return self.deliver(ep, error)
        if brief is None:
            return super().serve(ep, call)
        opening = chat.opening(self.fmt, brief, self.brief_system)[1]
        if not self.batch.fits(len(chat.encode(self.tok, opening)), self.max_stretch):
            return self.deliver(ep, "error: the brief is too long")
        self.started[me.root] += 1
        self.start(brief, ep.toolbox, self.brief_system, parent=ep)
        self.batch.park(ep.seq)                     # its slot is free while it waits

    def end(self, ep, status, answer=""):
        super().end(ep, status, answer)
        me = self.family[ep]
        ep.record.subagents = me.subagents
        if me.parent is not None:                   # the caller reads the outcome as its call's result
            self.family[me.parent].subagents.append(ep.record)
            self.deliver(me.parent, subagent_result(ep.record))


def new_batch(params, cfg, tok, fmt, *, n_prompts, slots=32, max_len=512, page_size=16, max_depth=MAX_DEPTH,
              max_subagents=MAX_SUBAGENTS, **batch_kw):
    """agent.new_batch with room in the pool for parked callers.

    Every sequence that can hold pages at once gets room for max_len: `slots` in a slot, plus
    the parked callers. The live episodes of one prompt form a chain (each waits for one
    sub-agent at most), and each parked one started a sub-agent at its own depth < max_depth:
    at most min(max_depth, max_subagents) per prompt. slots=1, 2 prompts, max_len of 4 pages:
    (1 + 2 * 1) * 4 + 1 (the null page) = 13 pages.
    """
    holders = slots + n_prompts * min(max_depth, max_subagents)
    return agent.new_batch(params, cfg, tok, fmt, slots=slots, max_len=max_len, page_size=page_size,
                           holders=holders, **batch_kw)


def run(batch, tok, fmt, prompts, toolboxes, *, system=None, brief_system=None, max_depth=MAX_DEPTH,
        max_subagents=MAX_SUBAGENTS, **loop_kw):
    """agent.run with sub-agents -> [Record]; record.subagents holds the Records of the sub-agents an
    episode started. `system` opens the episodes of `prompts` (as in agent.run), `brief_system` each
    sub-agent (its brief as the question)."""
    if len(prompts) != len(toolboxes):
        raise ValueError(f"{len(prompts)} prompts but {len(toolboxes)} toolboxes: one toolbox per episode")
    loop = SubAgentLoop(batch, tok, fmt, brief_system=brief_system, max_depth=max_depth,
                        max_subagents=max_subagents, **loop_kw)
    episodes = [loop.start(prompt, box, system) for prompt, box in zip(prompts, toolboxes)]
    loop.run()
    return [ep.record for ep in episodes]


def every_record(records):
    """The records and, after each, its sub-agents' records, depth first."""
    for r in records:
        yield r
        yield from every_record(r.subagents)
