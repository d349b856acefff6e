"""Compose serving.txt: seeded, template-built English paragraphs about running LLM inference.

The demo checkpoint's optional training (`inferops demo-model --train-steps N`) reads every
*.txt in this folder. No text is copied from anywhere: the templates and word lists below are
written for this project, and a seed makes the output identical on every run.

    .venv/bin/python runtime/engine/data/compose_corpus.py   # rewrites serving.txt
"""

from __future__ import annotations

import random
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "serving.txt"
SEED = 20261130
PARAGRAPHS = 420

SLOTS: dict[str, list[str]] = {
    "team": ["the platform team", "the on-call engineer", "our inference group", "the SRE team",
             "the serving team", "a small team of operators", "the night shift",
             "the capacity planner", "the release manager", "the finance analyst"],
    "model": ["the seven billion parameter model", "the small chat model", "the code assistant",
              "the summarisation model", "the new instruct model", "the distilled model",
              "the embeddings model", "the support bot", "the translation model",
              "the canary version"],
    "metric": ["time to first token", "time per output token", "end-to-end latency",
               "inter-token latency", "queue time", "request throughput", "goodput",
               "cache hit rate", "error rate", "cost per million tokens"],
    "component": ["the scheduler", "the gateway", "the block manager", "the replica",
                  "the prefix cache", "the tokenizer", "the load balancer", "the rate limiter",
                  "the router", "the KV cache", "the batch queue", "the health check"],
    "event": ["a traffic spike", "a slow rollout", "a noisy tenant", "a memory leak",
              "a burst of long prompts", "a failed node", "a bad deploy", "a cold start",
              "a sudden wave of retries", "a regional outage", "a quiet weekend",
              "the monthly report"],
    "action": ["shed the lowest priority traffic", "paused the rollout", "added two replicas",
               "lowered the maximum output length", "moved the canary back to zero percent",
               "raised the batch size", "turned on prefix caching", "split the long prompts",
               "routed traffic to the fallback deployment", "opened a ticket",
               "paged the owner", "rebuilt the routing table", "drained the old replicas",
               "doubled the KV cache blocks", "wrote a postmortem"],
    "number": ["two", "three", "four", "five", "ten", "twelve", "twenty", "forty", "fifty",
               "sixty four", "one hundred", "two hundred", "five hundred", "a thousand"],
    "unit": ["milliseconds", "seconds", "requests per second", "tokens per second", "replicas",
             "percent", "blocks", "minutes", "hours", "dollars"],
    "adjective": ["steady", "slow", "fast", "bursty", "healthy", "noisy", "stable", "uneven",
                  "predictable", "expensive", "cheap", "quiet", "busy", "degraded"],
    "time": ["this morning", "last night", "during the launch", "after lunch", "on monday",
             "at the end of the quarter", "before the holiday", "every hour", "at peak",
             "overnight", "over the weekend", "in the last release"],
    "reason": ["the batch was full", "the cache was cold", "the prompts were long",
               "one tenant sent most of the traffic", "the node was overloaded",
               "the queue grew faster than it drained", "the new version was slower",
               "the error budget was nearly spent", "the retries doubled the load",
               "the gateway kept a stale routing table", "memory ran short",
               "the prefix was shared by every request"],
    "tenant": ["the search tenant", "the mobile app", "the internal tools group",
               "the research lab", "a large customer", "the free tier", "the batch jobs",
               "the support desk", "the analytics team"],
    "slo": ["ninety nine percent of requests under two seconds",
            "first tokens within half a second", "fewer than one failed request in a thousand",
            "ninety five percent of tokens within fifty milliseconds",
            "a monthly availability of three nines", "goodput above forty requests per second"],
}

SENTENCES = [
    "{team} watched the {metric} of {model} {time}.",
    "When {event} arrived, {component} became {adjective}.",
    "The {metric} rose to {number} {unit} because {reason}.",
    "To protect the budget, {team} {action}.",
    "{tenant} sent {number} {unit} {time}, and {component} kept up.",
    "The objective for {model} is {slo}.",
    "After {event}, the {metric} stayed {adjective} for {number} {unit}.",
    "Nobody noticed {event} until {component} reported a {adjective} {metric}.",
    "We learned that {reason}, so {team} {action}.",
    "{component} now records the {metric} of every request, not only the average.",
    "The dashboard showed a {adjective} line for {metric} and a {adjective} line for the queue.",
    "If the {metric} burns the budget too fast, the system will page {team}.",
    "{model} answered {tenant} in {number} {unit} on a {adjective} day.",
    "A request waits in {component} while the batch is full, then it joins the next step.",
    "Each replica keeps its keys and values in small blocks, and {component} hands them out.",
    "When two prompts share a prefix, the cache reuses the blocks instead of computing them again.",
    "The report for {tenant} listed {number} {unit} and a {adjective} cost per token.",
    "{time}, {team} compared the built-in engine with a well known peer on the same model.",
    "A good benchmark names its peer, runs both in the same hour, and records the ratio.",
    "Because {reason}, the canary for {model} was held at five percent.",
    "The gateway counted tokens for {tenant} and refused requests over the limit.",
    "Latency is a distribution, so {team} reads the median and the ninety ninth percentile.",
    "During {event}, {team} {action} and the {metric} came back within {number} {unit}.",
    "The scheduler prefers short prompts when the queue is long, but it never starves old ones.",
    "{component} was {adjective} {time}, which nobody expected.",
    "An alert fired because {reason}; {team} {action}.",
    "Streaming lets the user read the first words while the model is still writing the rest.",
    "The cost of {model} fell after {team} {action}.",
]

OPENINGS = [
    "Notes from the {time} review.",
    "A short story about {event}.",
    "How {team} handled {event}.",
    "What we measured for {model}.",
    "A question from {tenant}.",
    "Lessons about {metric}.",
]


def fill(template: str, rng: random.Random) -> str:
    values = {slot: rng.choice(words) for slot, words in SLOTS.items()}
    sentence = template.format(**values)
    return sentence[0].upper() + sentence[1:]


def compose_paragraph(rng: random.Random) -> str:
    sentences = [fill(rng.choice(OPENINGS), rng)]
    sentences += [fill(rng.choice(SENTENCES), rng) for _ in range(rng.randint(4, 8))]
    return " ".join(sentences)


def compose(seed: int = SEED, paragraphs: int = PARAGRAPHS) -> str:
    rng = random.Random(seed)
    return "\n\n".join(compose_paragraph(rng) for _ in range(paragraphs)) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(compose(), encoding="utf-8")
    print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size:,} bytes)")
