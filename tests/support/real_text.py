"""Real text for the real-model tests: frozen here so that what they check never drifts.

Prompts of varied kinds and lengths (a few tokens to about a thousand), several sharing long
prefixes (so the prefix cache has something to share), chats through the model's template, and
text with multi-byte characters (French, Japanese, emoji) for the detokenizer.
"""

from __future__ import annotations

PAGED_ATTENTION = """\
Serving a large language model is mostly a memory problem. Every token a model has read or \
written leaves behind a key vector and a value vector in every attention layer, and the next \
token has to look at all of them. This key-value cache grows with every request and every step, \
and on a busy server it is the cache, not the weights, that decides how many requests fit on \
one accelerator at a time.

The first serving systems stored each request's cache as one contiguous tensor, reserved for \
the longest output the request might produce. Most requests stop long before that limit, so \
most of the reserved memory was never written. Measurements of such systems found that only a \
fifth to a third of the cache memory held useful state; the rest was lost to reservations that \
were never used, to internal fragmentation, and to gaps between allocations of different sizes.

Paged attention borrows the answer that operating systems found decades ago for the same \
problem. The cache is cut into blocks of a fixed number of tokens, sixteen for example, and a \
request owns a list of block numbers instead of one long tensor. A block is allocated only when \
the request actually needs it, so at most one partially filled block per request is wasted. The \
attention kernel reads the list, called a block table, and gathers the keys and values it needs \
from wherever the blocks happen to live in memory.

Blocks also make sharing cheap. Two requests that begin with the same system prompt can point at \
the same physical blocks for that prompt, and a reference count says how many requests use each \
block. When a request with several completions forks, the completions share every block of the \
prompt; the first completion that writes into a shared block that is only partly full gets its \
own copy first, which is the copy-on-write trick of an operating system's fork. With a hash of \
each full block's tokens, a server can even find blocks computed for an earlier request and \
reuse them, so a popular prefix is computed once and read many times.

The price is an extra level of indirection in the attention kernel and some bookkeeping in the \
scheduler, which must now decide what to do when the free blocks run out. It can stop admitting \
new requests, it can preempt a running request and recompute its cache later, or it can copy the \
request's blocks to host memory and bring them back when there is room again. In a cluster there \
is a fourth choice: hand the request, with its blocks, to another machine that has memory to \
spare. Each of these choices trades memory for time in a different way, and a good scheduler \
picks among them by measuring, not by guessing.
"""

PRINTING_PRESS = """\
Before the middle of the fifteenth century, a book in Europe was copied by hand. A scribe might \
spend months on a single volume, and the result was expensive enough that a library of a few \
hundred books was a sign of great wealth. Around 1450, in the German city of Mainz, Johannes \
Gutenberg combined several existing ideas into a system that changed this. He cast individual \
letters in a metal alloy that melted at a low temperature, arranged them into lines of text, \
inked them with an oil-based ink, and pressed paper against them with a press adapted from the \
ones used to make wine and olive oil.

The most famous product of his workshop is a Latin Bible, printed in two columns of forty-two \
lines. About one hundred and eighty copies were made, and roughly fifty of them survive today. \
Within fifty years, printing shops had opened in more than two hundred cities, and millions of \
books had been printed. Prices fell, literacy spread, and scholars could compare identical \
copies of the same text for the first time, which made it far easier to correct errors and to \
build on each other's work.
"""

BLOCK_PY = '''\
class Block:
    """One KV block: id, reference count, content hash, free-queue links.

    A block that holds full, hashed content keeps its hash while it sits in the free queue, so
    a later request with the same prefix can take it back ("cached, evictable").
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    @property
    def is_free(self) -> bool:
        return self.ref_cnt == 0


class FreeBlockQueue:
    """Doubly linked list of free blocks; its order is the eviction order.

    Blocks freed with nothing cached go to the head and are reused first; freed blocks that
    still hold cached content go to the tail, so they are evicted last. Removing a block from
    the middle (a cache hit on a free block) is O(1) through the intrusive links.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self._head: Block | None = None
        self._tail: Block | None = None
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head
        if block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev_free is not None:
            block.prev_free.next_free = block.next_free
        else:
            self._head = block.next_free
        if block.next_free is not None:
            block.next_free.prev_free = block.prev_free
        else:
            self._tail = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        block.prev_free, block.next_free = self._tail, None
        if self._tail is not None:
            self._tail.next_free = block
        else:
            self._head = block
        self._tail = block
        self.num_free += 1
'''

FRENCH = (
    "La tour Eiffel a été construite pour l'Exposition universelle de 1889 à Paris. "
    "Haute de plus de trois cents mètres, elle était à l'époque le plus haut édifice du "
    "monde, et beaucoup d'artistes trouvaient qu'elle défigurait la ville. Aujourd'hui, "
    "elle reçoit près de sept millions de visiteurs par an, et c'est l'un des monuments "
    "les plus célèbres de France. Au sommet, on peut voir"
)

JAPANESE = (
    "日本の首都は東京です。東京には多くの博物館や公園があり、春には桜が咲きます。"
    "富士山は日本で一番高い山で、天気の良い日には東京からも見えます。"
)

EMOJI = (
    "My favourite fruits are 🍎 apples, 🍌 bananas and 🍓 strawberries. My favourite animals are"
)


def chat(user: str, system: str | None = None) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": system}] if system else []
    return [*turns, {"role": "user", "content": user}]


def _cut(text: str, fraction: float) -> str:
    """The text up to the end of the sentence nearest `fraction` of its length."""
    end = text.rfind(". ", 0, int(len(text) * fraction))
    return text[: end + 1]


# Plain prompts, by kind (SmolLM2 token counts); several share long prefixes on purpose, so
# that the prefix cache has something to share.
PROMPTS: list[str] = [
    PRINTING_PRESS + "\n\n" + PAGED_ATTENTION,  # 782 tokens
    PAGED_ATTENTION,  # 549
    _cut(PAGED_ATTENTION, 0.55),  # 290, a prefix of the one above
    _cut(PAGED_ATTENTION, 0.3) + "\n\nIn one sentence, the problem is that",  # 140
    "# Python\n" + BLOCK_PY[: BLOCK_PY.index("    def popleft")],  # 343 tokens of code
    PRINTING_PRESS,  # 232, a prefix of the first
    FRENCH,  # 137
    JAPANESE,  # 130
    EMOJI,  # 23
    "The quick brown fox",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    'A JSON object describing a cat: {"name": "Tom", "age":',
]

# Chats (rendered with the model's template: they share its default system prompt).
CHATS: list[list[dict[str, str]]] = [
    chat("What is the capital of France?"),
    chat("Write a haiku about the sea."),
    chat("Explain paged attention in two sentences.", system="You are a concise expert."),
    chat("List three primary colors."),
]
