"""Relax's other built-in rewards: ``dapo``, ``deepscaler``, ``multiple_choice``, ``gpqa``, ``f1``, ``random`` and
``remote_rm``, scored by Relax's rules (``relax/engine/rewards/``); :data:`BUILTIN_REWARDS`
lists them. Each scorer is ``(response, label, metadata) -> float`` (``dapo``: a dict, read with
``rollout.reward_key: score``), except :func:`remote_rm`, which the :class:`~relax_hpc.rollout.rewards.runner.RewardRunner`
awaits itself (it needs the prompt and ``rollout.rm_url``), and :func:`dapo_genrm_reward`, which it awaits with the run's
judge (:mod:`relax_hpc.rollout.genrm`).

Also the rule rewards ``math``, ``exact_match`` and ``dummy``, and the table of all of them
(:data:`BUILTIN_REWARDS`, :func:`builtin_reward`). The math helpers come from the leaf
:mod:`relax_hpc.rollout.rewards.answers`. No torch here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import string
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any, Callable

from relax_hpc.rollout.config import AWAITED_REWARDS, BUILTIN_REWARD_NAMES  # noqa: F401 (AWAITED_REWARDS: read from here too)
from relax_hpc.rollout.rewards.answers import label_answer, extract_answer, extract_boxed, math_equal
from relax_hpc.threads import in_daemon_thread

_log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# dapo: DAPO's math verify (Minerva "Answer: ..." extraction, integer answers), as Relax's math_dapo_utils
# --------------------------------------------------------------------------------------------------

_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL = 300  # only the response's last 300 characters are read (Relax: the longest MATH-500 answer is 159)
_DAPO_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DAPO_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
              "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
              "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
              "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
              ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")


def dapo_normalize(answer: Any) -> str:
    """DAPO's (lm-eval's Minerva) normalization of a final answer: the part after the last ``=``, units and
    spacing dropped, ``$``/``\\text{}``/``\\textbf{}``/``\\overline{}``/``\\boxed{}`` unwrapped, ``\\fracab`` and
    ``\\sqrta`` braced, ``1,000`` -> ``1000``."""
    s = str(answer).split("=")[-1]
    for old, new in _DAPO_REPLACE:
        s = s.replace(old, new)
    for word in _DAPO_DROP:
        s = s.replace(word, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for macro in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + macro + r"\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_reward(response: str, label: Any, metadata: dict | None = None) -> dict[str, Any]:
    """``{"score": 1.0 | -1.0, "acc": 1.0 | 0.0, "pred": str}`` (Relax's keys; use ``rollout.reward_key: score``).

    The prediction is the last ``Answer: ...`` line within the response's last 300 characters, normalized
    (``[INVALID]`` when there is none); the label, normalized, must be an integer (DAPO's answers all are) and
    the two must then be the same string. Relax's ``acc`` is a bool; here it is 1.0/0.0 so it is logged.
    """
    found = _DAPO_ANSWER.findall((response or "")[-_DAPO_TAIL:])
    pred = dapo_normalize(found[-1] if found else "[INVALID]")
    gold = dapo_normalize(label)
    try:
        gold = str(int(float(gold)))
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"dapo: the label {label!r} is not an integer (normalized: {gold!r}); DAPO's rule compares "
                         "integer answers only. Fix: use rm_type math for this data, or fix the label") from None
    correct = pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0, "pred": pred}


# --------------------------------------------------------------------------------------------------
# deepscaler: the final \boxed{} after the reasoning, graded as math
# --------------------------------------------------------------------------------------------------


def deepscaler_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """Relax's DeepScaleR rule: only the text after the last ``</think>`` (else after the first
    ``###Response``) counts, no such marker is 0; its last ``\\boxed{}`` must equal the label (itself reduced to
    its ``\\boxed{}`` when it has one). An empty label is 0. Equality is relax_hpc's ``math_equal`` (Relax uses
    the MATH and sympy graders; both accept the same numeric and normalized-string forms in the common cases)."""

    response = response or ""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    answer = extract_boxed(solution)
    if answer is None or label is None or label == "":
        return 0.0
    truth = str(label)
    if "\\boxed" in truth:
        truth = extract_boxed(truth)
        if truth is None:
            return 0.0
    return 1.0 if math_equal(answer, truth) else 0.0


# --------------------------------------------------------------------------------------------------
# multiple_choice, gpqa: option letters
# --------------------------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)


def _tagged(text: Any) -> str:
    text = "" if text is None else str(text)
    m = _ANSWER_TAG.search(text)
    return m.group(1).strip() if m else text.strip()


def multiple_choice_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 if the first ``<answer>...</answer>`` of the response equals that of the label (either one without
    the tag counts whole, stripped), else 0.0. Case matters: ``<answer>b</answer>`` does not match ``B``."""
    return 1.0 if _tagged(response) == _tagged(label) else 0.0


_GPQA_PATTERNS = (r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
                  r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
                  r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])")


def _after_think(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _gpqa_letter(response: str, valid: list[str]) -> str | None:
    text = _after_think(response)
    for pattern in _GPQA_PATTERNS:
        m = re.search(pattern, text, flags=re.IGNORECASE)
        if m and m.group(1).upper() in valid:
            return m.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """Relax's GPQA rule (0.0 or 1.0). The correct letter is ``metadata["correct_letter"]``, else the label when it
    is one valid letter, else the option at the label's index (an int), else the letter of the option whose text
    equals the label. Valid letters: ``metadata["valid_letters"]``, else A.. for each of ``metadata["choices"]``,
    else A-J. The chosen letter (after any ``</think>``) is the first "answer/option/choice (is|:) X", "X is
    (the) correct" or "final answer X", else the last standalone valid capital. If both letters are known they
    must agree; otherwise the response scores 1 when it contains the correct option's text (or
    ``metadata["correct_answer"]``/``["answer_text"]``, or a label that is not a letter) as whole words."""
    if response is None:
        return 0.0
    meta = metadata or {}
    choices = meta.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else (list(choices) if choices is not None else None)
    if meta.get("valid_letters"):
        valid = [str(x).upper() for x in meta["valid_letters"]]
    elif choices:
        valid = list(string.ascii_uppercase[:len(choices)])
    else:
        valid = list(string.ascii_uppercase[:10])
    correct = meta.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text, matched_choice = None, None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in valid and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)) and not isinstance(label, bool):
        if 0 <= int(label) < len(valid):
            correct = valid[int(label)]
    if not correct and choices and label_text:
        for i, choice in enumerate(choices):
            if _words(str(choice)) == _words(label_text):
                correct, matched_choice = valid[i], choice
                break
    letter = _gpqa_letter(response, valid)
    if letter and correct:
        return 1.0 if letter == correct else 0.0
    targets = []
    if correct and choices and correct in valid and valid.index(correct) < len(choices):
        targets.append(str(choices[valid.index(correct)]))
    for key in ("correct_answer", "answer_text"):
        if meta.get(key):
            targets.append(str(meta[key]))
    if matched_choice is not None and not meta.get("correct_answer"):
        targets.append(str(matched_choice))  # Relax records it as metadata["correct_answer"]
    if label_text and not (len(label_text) == 1 and label_text.upper() in valid):
        targets.append(label_text)
    said = f" {_words(_after_think(response))} "
    if any(t and f" {t} " in said for t in (_words(x) for x in targets)):
        return 1.0
    if letter and not correct and label_text:
        return 1.0 if letter == label_text.upper() else 0.0
    return 0.0


# --------------------------------------------------------------------------------------------------
# f1, random
# --------------------------------------------------------------------------------------------------


def _qa_normalize(text: Any) -> str:
    """SQuAD/HotpotQA normalization: lowercase, punctuation and the articles a/an/the dropped, spaces collapsed."""
    s = "".join(ch for ch in str(text if text is not None else "").lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def f1_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """HotpotQA token F1 (Relax's ``f1``): both normalized (lowercase, no punctuation, no a/an/the); when either is
    yes/no/noanswer the two must be equal (else 0); else the F1 of the shared tokens (with multiplicity)."""
    pred, gold = _qa_normalize(response), _qa_normalize(label)
    if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
        return 0.0
    p, g = pred.split(), gold.split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def random_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """0.0 or 1.0 at random, from Python's global ``random`` (unseeded here, as in Relax): a baseline/smoke test."""
    return float(random.randint(0, 1))


# --------------------------------------------------------------------------------------------------
# remote_rm: POST {prompt, response, label} to rollout.rm_url
# --------------------------------------------------------------------------------------------------

REMOTE_RM_ATTEMPTS = 10  # Relax's max_retries: attempts in all
REMOTE_RM_BACKOFF_S = 1.0  # sleep before attempt k+1: min(BACKOFF_S * 2**k, BACKOFF_CAP_S) + U(0, BACKOFF_S)
REMOTE_RM_BACKOFF_CAP_S = 30.0
REMOTE_RM_REQUEST_TIMEOUT_S = 120.0  # one request (Relax's aiohttp total timeout); reward_timeout_s bounds all


class RemoteRewardError(RuntimeError):
    """remote_rm gave up: every attempt failed."""


class RemoteRewardTimeout(TimeoutError):
    """remote_rm ran out of ``rollout.reward_timeout_s`` before an answer."""


def remote_rm_unawaited(response: str, label: Any, metadata: dict | None = None) -> float:
    """``BUILTIN_REWARDS["remote_rm"]``: remote_rm needs the prompt and ``rollout.rm_url``, so only the reward
    runner (which awaits :func:`remote_rm`) can score it; ``boxed_remote_rm`` is refused here."""
    raise TypeError("rm_type remote_rm is scored by the reward runner (it POSTs the whole sample to rollout.rm_url); "
                    "it cannot be called as a plain scorer, nor as boxed_remote_rm. Fix: use rm_type remote_rm")


def _post_json(url: str, payload: bytes, timeout_s: float) -> Any:
    req = urllib.request.Request(url, data=payload, method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (http(s) only, checked by validate)
        return json.loads(resp.read().decode("utf-8"))


def _why(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return f"{type(e.reason).__name__}: {e.reason}"
    return f"{type(e).__name__}: {e}"


async def remote_rm(url: str | None, prompt: Any, response: str, label: Any, *, timeout_s: float,
                    attempts: int | None = None) -> Any:
    """The server's JSON answer to ``POST url {"prompt", "response", "label"}`` (a number, or a dict for
    ``rollout.reward_key``). A failed attempt (connection error, HTTP error status, a body that is not JSON) is
    retried up to ``attempts`` (10) in all, sleeping ``min(2**k, 30) + U(0, 1)`` s between them, as Relax does;
    ``timeout_s`` (``rollout.reward_timeout_s``) bounds the whole call, retries and sleeps included. Raises
    :class:`RemoteRewardError` or :class:`RemoteRewardTimeout`, naming the URL and the last error."""

    if not url:
        raise ValueError("rm_type remote_rm needs rollout.rm_url (Relax --rm-url), the reward server's http(s) URL. "
                         "Fix: set rollout.rm_url")
    attempts = REMOTE_RM_ATTEMPTS if attempts is None else attempts
    body = json.dumps({"prompt": prompt, "response": response, "label": label}).encode("utf-8")
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    tried = 0
    try:
        async with asyncio.timeout(timeout_s):
            for k in range(attempts):
                tried = k + 1
                left = max(deadline - time.monotonic(), 0.001)
                try:
                    return await in_daemon_thread(_post_json, url, body, min(REMOTE_RM_REQUEST_TIMEOUT_S, left),
                                                  thread_name="reward _post_json")
                except Exception as e:  # any failure is retried, as Relax's remote_rm does
                    last = e
                if k + 1 < attempts:
                    await asyncio.sleep(min(REMOTE_RM_BACKOFF_S * 2 ** k, REMOTE_RM_BACKOFF_CAP_S)
                                        + random.random() * REMOTE_RM_BACKOFF_S)
    except TimeoutError:
        why = f"; last error: {_why(last)}" if last is not None else ""
        raise RemoteRewardTimeout(
            f"remote_rm: POST {url} gave no reward within {timeout_s:g} s (rollout.reward_timeout_s), {tried} "
            f"attempt(s){why}. Fix: check that the reward server at {url} is up and answers, or raise "
            "rollout.reward_timeout_s") from None
    raise RemoteRewardError(f"remote_rm: POST {url} failed {attempts} times; last error: {_why(last)}. Fix: check "
                            f"the reward server at {url} (it must answer the JSON body {{prompt, response, label}} "
                            "with a JSON number or object)") from last


# --------------------------------------------------------------------------------------------------
# dapo-genrm: an LLM judge (the run's genrm role) compares the extracted answer with the label, Relax's rule
# (relax/engine/rewards/dapo_genrm.py, the version with the format check)
# --------------------------------------------------------------------------------------------------

GENRM_MAX_ANSWER = 500  # a longer "answer" is refused without a call: stuffing the slot must not sway the judge
GENRM_VERDICT_HEAD = 16  # the verdict is read from this many characters after any "Judgement:"
_GENRM_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*(.+?)(?:\n|$)")
GENRM_JUDGE_PROMPT = (
    "You compare two answers to one question. [Question] is the question, [Standard Answer] its correct answer, and "
    "[Model_answer] the answer taken from a model's output. Decide whether the two answers agree: they agree when they "
    "mean the same thing, whatever the notation (e.g. '\\frac{{1}}{{2}}' and '0.5', or '145' and 'the answer is 145').\n"
    "Output only the Judgement: 1 if they agree, 0 if they differ.\n"
    "\n[Question]: What is 3 + 4?\n[Standard Answer]: 7\n[Model_answer] : 7\nJudgement: 1\n"
    "\n[Question]: Halve 3.\n[Standard Answer]: 3/2\n[Model_answer] : \\frac{{3}}{{2}}\nJudgement: 1\n"
    "\n[Question]: Find $y$.\n[Standard Answer]: 5\n[Model_answer] : 6\nJudgement: 0\n"
    "\n[Question]: {question}\n[Standard Answer]: {ground_truth}\n[Model_answer] : {answer}\nJudgement:")


def dapo_genrm_unawaited(response: str, label: Any, metadata: dict | None = None) -> float:
    """``BUILTIN_REWARDS["dapo-genrm"]``: the judge is asked by the reward runner (:func:`dapo_genrm_reward`), so
    it cannot be a plain scorer, nor ``boxed_dapo-genrm``."""
    raise TypeError("rm_type dapo-genrm is scored by the reward runner (it asks the run's judge, roles.genrm, and "
                    "extracts the answer itself); it cannot be called as a plain scorer, nor as boxed_dapo-genrm. "
                    "Fix: use rm_type dapo-genrm")


def genrm_extract_answer(response: str | None) -> str | None:
    """The answer a judge is shown: the last ``\\boxed{...}`` (braces balanced, non-empty), else what follows the
    last ``Answer:`` on its line; None when there is neither, or that is blank (Relax sends a blank answer to the
    judge; here it is missing, and costs no call)."""
    text = response or ""
    i = text.rfind("\\boxed{")
    if i >= 0:
        start, depth = i + len("\\boxed{"), 1
        for j in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                if text[start:j].strip():
                    return text[start:j].strip()
                break
    lines = _GENRM_ANSWER_LINE.findall(text)
    return (lines[-1].strip() or None) if lines else None  # Relax would judge a blank "Answer:" as ""


def genrm_verdict(judge_response: str) -> tuple[float | None, str]:
    """``(1.0 | 0.0 | None, prediction)``: the text after any "Judgement:", then "1" anywhere in its first 16
    characters is 1, else "0" there is 0, else None (unrecognized: scored 0)."""
    pred = judge_response.strip()
    if "Judgement:" in pred:
        pred = pred.split("Judgement:")[-1].strip()
    head = pred[:GENRM_VERDICT_HEAD]
    return (1.0 if "1" in head else 0.0 if "0" in head else None), pred


def _question_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn is the question
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return "" if prompt is None else str(prompt)


async def dapo_genrm_reward(prompt: Any, response: str, label: Any, metadata: dict | None, judge: Any) -> dict[str, Any]:
    """``{score, acc, pred, judge_response, format_error}`` (use ``rollout.reward_key: score``), Relax's rule:

    - the answer is :func:`genrm_extract_answer` of the response; none → ``format_error: answer_missing``, longer than
      500 characters → ``answer_too_long``, both score 0 **without a judge call**;
    - the judge (``judge(messages) -> str``, :func:`relax_hpc.rollout.genrm.generate`) gets the question
      (``metadata["question"]``, else the prompt), the standard answer (``metadata["label"]``, else the label) and the
      answer; a judge call that fails after the client's retries scores 0 with ``judge_transient_error`` (one flaky
      judge must not fail the step), unless the judge refused it (4xx), which raises (stricter than Relax);
    - the verdict is :func:`genrm_verdict`; an unrecognized one scores 0 (logged), ``format_error`` "".
    ``acc`` is 1.0/0.0 (Relax's is an int) so it is logged as ``rollout/acc/mean``."""
    from relax_hpc.rollout.genrm import GenRMError

    meta = metadata if isinstance(metadata, dict) else {}
    none = {"score": 0.0, "acc": 0.0, "pred": "", "judge_response": ""}
    answer = genrm_extract_answer(response)
    if answer is None:
        return {**none, "format_error": "answer_missing"}
    if len(answer) > GENRM_MAX_ANSWER:
        return {**none, "format_error": "answer_too_long"}
    question = meta.get("question", _question_text(prompt))
    truth = meta.get("label", label)
    content = GENRM_JUDGE_PROMPT.format(question=question, ground_truth=truth, answer=answer)
    try:
        judged = await judge([{"role": "user", "content": content}])
    except GenRMError as e:
        if not e.transient:  # a judge that refuses the request would refuse every one: a reward failure, not a 0
            raise
        _log.error("dapo-genrm: the judge call failed after its retries; the sample scores 0: %s", e)
        return {**none, "format_error": "judge_transient_error"}
    score, pred = genrm_verdict(judged)
    if score is None:
        _log.warning("dapo-genrm: the judge's answer %r has no 1 or 0 in its head; scored 0", pred[:80])
    return {"score": score or 0.0, "acc": score or 0.0, "pred": pred, "judge_response": judged, "format_error": ""}


# --------------------------------------------------------------------------------------------------
# Built-in rewards: (response, label, metadata) -> float
# --------------------------------------------------------------------------------------------------


def math_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 if the response's final answer (last ``\\boxed{}``, else "####", else last number) equals the label."""
    return 1.0 if math_equal(extract_answer(response), label_answer(label)) else 0.0


def exact_match_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 if the response, stripped, equals the label, stripped."""
    return 1.0 if label is not None and (response or "").strip() == str(label).strip() else 0.0


def dummy_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """0.0 for everything (the real score comes later, e.g. from a post-process step)."""
    return 0.0


BUILTIN_REWARDS: dict[str, Callable[[str, Any, dict | None], Any]] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "f1": f1_reward,
    "dummy": dummy_reward,
    # Relax's others, by Relax's rules (this module)
    "dapo": dapo_reward,  # a dict {score, acc, pred}: use rollout.reward_key: score
    "deepscaler": deepscaler_reward,
    "multiple_choice": multiple_choice_reward,
    "gpqa": gpqa_reward,
    "random": random_reward,
    "remote_rm": remote_rm_unawaited,  # awaited by RewardRunner (POST to rollout.rm_url)
    "dapo-genrm": dapo_genrm_unawaited,  # awaited by RewardRunner (asks the run's judge, roles.genrm)
}
if tuple(BUILTIN_REWARDS) != BUILTIN_REWARD_NAMES:  # the recipe's check reads the names from the config module
    raise ImportError(f"BUILTIN_REWARDS {tuple(BUILTIN_REWARDS)} and rollout.config.BUILTIN_REWARD_NAMES "
                      f"{BUILTIN_REWARD_NAMES} differ. Fix: name a new reward in both")


def builtin_reward(rm_type: str, response: str, label: Any, metadata: dict | None = None) -> float:
    """Score with built-in ``rm_type``; ``boxed_<type>`` scores the last ``\\boxed{}`` content with ``<type>``."""
    if rm_type.startswith("boxed_"):
        inner = rm_type[len("boxed_"):]
        return builtin_reward(inner, extract_boxed(response) or "", label, metadata)
    fn = BUILTIN_REWARDS.get(rm_type)
    if fn is None:
        raise ValueError(f"unknown rm_type {rm_type!r}. Fix: use one of {', '.join(BUILTIN_REWARDS)} "
                         "(or boxed_<one of them>), or set rollout.custom_rm_path")
    return fn(response, label, metadata)
