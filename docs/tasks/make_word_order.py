"""Build the word-order evaluation sets of docs/tasks.md (run from this folder).

Each item is a line as written and the same line with two neighbouring words swapped
(never the first word), in random order. Both choices hold exactly the same characters, so
a model that has not learned the language scores them alike (chance, 0.5); one that has
prefers the line as written.
"""

import json
import random

PYTHON = """for item in items:
while x is not None:
if key in mapping:
return a + b
with open(path) as f:
except ValueError as error:
from os import path
import os.path as osp
def f(x): return x * 2
class Point(object): pass
x = len(items) + 1
if not items: return None
for key, value in d.items():
print(x, end=' ')
raise TypeError('not a number')
elif x is None: pass
lambda x: x + 1
yield from range(10)
result = [x for x in data if x]
else: return value
self.value = value
return self.value + 1
del items[0] and x
if x == 0 or y == 0:
while True: break
async def main(): pass
await asyncio.sleep(1) or x
x = y if y else z
return list(map(str, items))
def __init__(self, name):
for i in range(len(items)):
from typing import List
if __name__ == '__main__':
import collections as c
return x is not None
if a and not b:
for line in open(path):
x = [] if a else b
print(i, x, file=f)
raise StopIteration from None
with lock: count += 1"""

SHAKESPEARE = """I know not what thou sayest.
What is thy name, good sir?
Give me thy hand, my lord.
The king is dead, long live the king.
I pray you, tell me where he is.
Now is the winter of our discontent.
O Romeo, wherefore art thou Romeo?
All the world is a stage.
What light through yonder window breaks?
I will not go with thee to the court.
My lord, the queen is dead.
Good night, sweet prince, and flights of angels.
Let us go in together.
Why dost thou weep, my child?
He is a noble gentleman of Rome.
Come, let us to the castle.
I have done the state some service.
The fault is not in our stars.
Speak to me, for I am your friend.
What says my brother to the king?
Thou art a villain and a fool.
I am as true as truth itself.
Go tell the duke that I am here.
She is the fairest lady in the land.
We must away before the morning.
Where is the duke, my gracious lord?
I do beseech you, hear me speak.
The gods have made me what I am.
Farewell, my lord, I will be gone.
Is this a dagger which I see before me?"""


def swapped(line: str, rng: random.Random) -> str:
    words = line.split(" ")
    i = rng.randrange(1, len(words) - 1)
    words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def write(path: str, lines: str, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for line in lines.splitlines():
            bad = swapped(line, rng)
            gold = rng.randrange(2)
            choices = [line, bad] if gold == 0 else [bad, line]
            f.write(json.dumps({"context": "", "choices": choices, "gold": gold}) + "\n")


if __name__ == "__main__":
    write("python-word-order.jsonl", PYTHON, seed=1)
    write("shakespeare-word-order.jsonl", SHAKESPEARE, seed=2)
