"""The baselines a fine-tuned model must beat: a bag-of-words classifier, and chance.

A simple classifier is often the right baseline, and sometimes enough (design
document 3). This one reads a request as the set of its words and picks a tool
with a softmax over linear scores: multinomial logistic regression, trained by
full-batch gradient descent from zero weights, so the same data always gives the
same model.

    model = fit(["where is A1234", "refund 40 on A1234"], ["order_status", "refund"])
    predict(model, ["where is my parcel"])   -> ["order_status"]     ("where" was seen with it)

Words it never saw in training weigh nothing: on new phrasings ("Can you track
A5617 for me?") it falls back on the few words it knows, and on the class bias.

Shape letters (as in the legend of minagent/model.py): B texts, U words of the bag-of-words vocabulary, C classes.
"""

import random
import re

import numpy as np

from minagent.tasks.shop import gate


def words(text):
    """words("Refund $240 on A1234!") -> ["refund", "<num>", "on", "a", "<num>"]

    Lowercase letters runs are words; every run of digits is the one word "<num>":
    the value of an amount or an order number says nothing about the tool."""
    return ["<num>" if w[0].isdigit() else w for w in re.findall(r"[a-z]+|[0-9]+", text.lower())]


def features(vocab, texts):
    """Texts -> X_BxU, 1.0 where the text contains the word (each word counted once)."""
    index = {w: i for i, w in enumerate(vocab)}
    X_BxU = np.zeros((len(texts), len(vocab)))
    for n, text in enumerate(texts):
        for w in words(text):
            if w in index:
                X_BxU[n, index[w]] = 1.0
    return X_BxU


def fit(texts, labels, l2=1e-3, lr=1.0, steps=300):
    """-> model, a dict: "vocab" (U,) and "classes" (C,) as str arrays, "W" (U, C), "b" (C,).

    Minimises the mean cross-entropy + l2/2 * |W|^2 (the bias is not penalised)."""
    vocab = np.array(sorted({w for text in texts for w in words(text)}), dtype=str)
    classes = np.array(sorted(set(labels)), dtype=str)
    X_BxU = features(vocab, texts)
    Y_BxC = (np.asarray(labels, dtype=str)[:, None] == classes[None, :]).astype(float)    # one-hot
    W_UxC, b_C = np.zeros((len(vocab), len(classes))), np.zeros(len(classes))
    for _ in range(steps):
        P_BxC = softmax(X_BxU @ W_UxC + b_C)
        G_BxC = (P_BxC - Y_BxC) / len(texts)          # d(mean cross-entropy) / d(logits)
        W_UxC -= lr * (X_BxU.T @ G_BxC + l2 * W_UxC)
        b_C -= lr * G_BxC.sum(axis=0)
    return {"vocab": vocab, "classes": classes, "W": W_UxC, "b": b_C}


def softmax(z_BxC):
    e_BxC = np.exp(z_BxC - z_BxC.max(axis=1, keepdims=True))   # minus the max: no overflow
    return e_BxC / e_BxC.sum(axis=1, keepdims=True)


def predict(model, texts):
    """-> the most likely label of each text (ties go to the first class in sorted order)."""
    logits_BxC = features(model["vocab"], texts) @ model["W"] + model["b"]
    return [str(model["classes"][i]) for i in logits_BxC.argmax(axis=1)]


def random_baseline(requests, seed=0):
    """A tool drawn uniformly among the five for each request: right 20 % of the time on average."""
    rng = random.Random(seed)
    return [rng.choice(tuple(gate.TOOLS)) for _ in requests]
