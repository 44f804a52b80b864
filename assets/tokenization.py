"""The two tokenizers of the bundled models, built with the `tokenizers` library from the world's vocabulary.

- LM tokenizer (shared by tiny-target and tiny-draft): word level, case-sensitive, ChatML-like chat template,
  special tokens first in the vocabulary (`<|pad|>` 0, `<|unk|>` 1, `<|im_start|>` 2, `<|im_end|>` 3 = EOS).
- Reward tokenizer (tiny-reward): WordPiece (lemma + `##s`/`##es`/`##d`/`##ed`/`##ing` pieces where the
  inflection splits cleanly, whole words otherwise), a prompt-first "### User: ... ### Assistant: ..." template
  (the request upper-cased, then the response lower-cased) framed by `[BOS]` ... `[EOS]`, lower-case words in
  alphabetical order, then upper-case request words, and the special tokens LAST in the vocabulary. Ids, special
  tokens, casing, segmentation and template all differ from the LM tokenizer on purpose: a reward has to be
  computed by decoding the response to text and re-tokenising it.

Why prompt first: Winnow scores partial responses again and again as they grow (Speculative Rejection's decisions)
and keeps each candidate's reward-model KV cache between scores. With the prompt first, the prompt is encoded once
for all its candidates and a decision feeds only the response's new tokens plus the end of the turn (`[EOS]`, one
token: the newline is whitespace to the pre-tokenizer). The first version rendered the response first and the
request after it, so that each concept of the request could look back at the response; but then the whole request
sat in the end-of-turn tail that moves as the response grows, and was fed again at every decision for every
candidate (Speculative Rejection fed more reward tokens than Best-of-N). Now each response word looks back at the
request instead (is it one of the requested concepts, and its first occurrence?), and `[EOS]` counts.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from assets import world

LM_SPECIALS = ["<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
LM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

RM_SPECIALS = ["[UNK]", "[PAD]", "[BOS]", "[EOS]"]
RM_SUFFIXES = ["##s", "##es", "##d", "##ed", "##ing"]
# Every turn in order, the prompt first: "### User: " + the request upper-cased, then "### Assistant: " + the
# response lower-cased, then [EOS] (where the score is read). A causal reward model lets each word of the response
# look back at the request and see whether it is a requested concept; the casing makes a concept in the request
# ("DOG") a different token from the same word in the response ("dog"), so a "same word" match can tell the two
# apart from the first layer on (a lower-cased request trained worse: validation RMSE 0.078 against 0.057 on whole
# responses, 0.131 against 0.125 overall). A response that grows keeps its cache: only its new tokens and [EOS] are
# fed.
RM_CHAT_TEMPLATE = (
    "[BOS]"
    "{% for message in messages %}"
    "### {{ message['role'] | capitalize }}: "
    "{{ message['content'] | lower if message['role'] == 'assistant' else message['content'] | upper }}\n"
    "{% endfor %}"
    "[EOS]"
)


def build_lm_tokenizer() -> PreTrainedTokenizerFast:
    vocab: dict[str, int] = {}
    for w in LM_SPECIALS + ["system", "user", "assistant"] + world.all_words():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    # WordPiece's decoder joins words with spaces; cleanup=True attaches "." and "," to the previous word
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|unk|>",
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=LM_CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=256,
    )
    return fast


def _rm_tokenizer(words: list[str]) -> Tokenizer:
    vocab: dict[str, int] = {}
    for w in words + RM_SUFFIXES + RM_SPECIALS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tok


def build_reward_tokenizer() -> PreTrainedTokenizerFast:
    lemmas = sorted(world.ROLE_OF)
    lower = {w.lower() for w in world.FUNCTION_WORDS + world.STARTERS + world.PREPOSITIONS + world.ADJECTIVES
             + world.ADVERBS + world.WEATHER + world.MOODS + world.PROMPT_WORDS} | set(lemmas)
    lower |= {"#", ":", ",", "."}
    # the request side (upper-cased by the template): the prompt words and every concept lemma
    upper = {w.upper() for w in world.PROMPT_WORDS + lemmas} | {"Assistant", "User", "System"}
    base = sorted(lower) + sorted(upper - lower)
    # inflected forms: keep them split as lemma + suffix piece when WordPiece does that, else add the whole word
    probe = _rm_tokenizer(base)
    extra: list[str] = []
    for lemma in lemmas:
        for form in world.surface_forms(lemma)[1:]:
            pieces = probe.encode(form, add_special_tokens=False).tokens
            if not (len(pieces) == 2 and pieces[0] == lemma and pieces[1] in RM_SUFFIXES):
                extra.append(form)
    words = sorted(lower | set(extra)) + sorted(upper - lower)
    tok = _rm_tokenizer(words)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        chat_template=RM_CHAT_TEMPLATE,
        padding_side="right",
        model_max_length=256,
    )
    return fast
