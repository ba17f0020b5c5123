"""The "tasks" request kind of ``speculant.distill``: everyday programming tasks, asked from scratch.

The scratch kind asks for equivalents of documented functions of the installed packages, which
are often narrow ("an equivalent of `sympy.printing.julia.julia_code` in C"). What a coding
assistant is asked most is broader: a well-known algorithm, data structure, small tool or
exercise, in some language, often with "only code". This catalog holds such tasks, written for
this project, each asked in several languages and phrasings.

Left out on purpose, so that no head is trained on what it is measured on: sorting demos
(the public benchmark's free-quicksort-c asks for one) and the asks of ``scripts/dev_workloads.py
--free`` (an LRU cache, a generic stack, a table of packages), the independent check of a head.
:data:`EXCLUDED` lists the words no request may contain; a test holds the catalog to it.
"""
from __future__ import annotations

import hashlib
from typing import Iterator

__all__ = ["EXCLUDED", "TASK_ASKS", "TASKS", "task_requests"]

# (what to build, a sentence on what it must do)
TASKS = (
    ("binary search", "find the index of a value in a sorted array, or report that it is absent"),
    ("linked list", "a singly linked list with insert at head, append, remove by value and printing"),
    ("doubly linked list", "a doubly linked list with push and pop at both ends and a forward and backward walk"),
    ("queue", "a FIFO queue backed by a ring buffer that grows when full"),
    ("binary search tree", "insert, search, delete and an in-order traversal"),
    ("min-heap", "a binary min-heap with push, pop and peek, and a check on a few numbers"),
    ("hash map", "a hash map with separate chaining, get, put, remove and resizing"),
    ("trie", "a prefix tree that stores words and lists all words with a given prefix"),
    ("union-find", "a disjoint-set structure with path compression and union by rank"),
    ("graph BFS", "breadth-first search on an adjacency list, printing the visit order"),
    ("graph DFS", "iterative depth-first search on an adjacency list, detecting a cycle"),
    ("Dijkstra shortest-path routine", "shortest distances from one node in a weighted graph with a priority queue"),
    ("topological sort", "order the tasks of a dependency graph, reporting a cycle if there is one"),
    ("matrix multiplication routine", "multiply two matrices of compatible sizes and print the result"),
    ("matrix transpose routine", "transpose a rectangular matrix in place or into a new one"),
    ("Fibonacci function", "the n-th Fibonacci number, iteratively and with memoized recursion"),
    ("factorial function", "the factorial of n with overflow checking"),
    ("prime sieve", "all primes below n with the sieve of Eratosthenes"),
    ("greatest common divisor function", "gcd and lcm of two integers with Euclid's algorithm"),
    ("fast exponentiation routine", "modular exponentiation by squaring"),
    ("FizzBuzz", "print 1 to 100 with Fizz, Buzz and FizzBuzz for multiples of 3, 5 and 15"),
    ("palindrome checker", "tell whether a string is a palindrome, ignoring case and punctuation"),
    ("anagram grouper", "group a list of words into sets of anagrams"),
    ("word frequency counter", "read text and print the ten most frequent words with their counts"),
    ("string reversal routine", "reverse a string, and reverse the order of words in a sentence"),
    ("Caesar cipher", "encrypt and decrypt text with a shift cipher"),
    ("run-length encoding", "encode and decode strings with run-length encoding"),
    ("Roman numeral converter", "convert integers to Roman numerals and back"),
    ("temperature converter", "convert between Celsius, Fahrenheit and Kelvin"),
    ("bank account", "a bank account with deposit, withdraw, balance and an error on overdraft"),
    ("to-do list", "a command-line to-do list that adds, lists, completes and deletes items"),
    ("tic-tac-toe", "a two-player tic-tac-toe game on the console with win detection"),
    ("Conway's Game of Life", "step a grid of cells through a few generations and print each one"),
    ("guess the number", "a game where the user guesses a random number with higher/lower hints"),
    ("rock paper scissors", "play rounds against the computer and keep the score"),
    ("CSV reader", "parse a CSV file with quoted fields and print each row's columns"),
    ("JSON pretty-printer", "read JSON and print it indented"),
    ("INI parser", "parse an INI file into sections of key-value pairs"),
    ("command-line argument parser", "parse flags and positional arguments and print what was given"),
    ("file line counter", "count the lines, words and characters of a file, like wc"),
    ("directory walker", "list every file under a directory with its size, largest first"),
    ("grep clone", "print the lines of a file that match a pattern, with line numbers"),
    ("log parser", "read web server log lines and count requests per status code"),
    ("HTTP GET client", "fetch a URL and print the status code and the first lines of the body"),
    ("simple HTTP server", "serve a hello message and a JSON endpoint on a local port"),
    ("REST API client", "call a JSON API, parse the response and handle errors"),
    ("TCP echo server", "accept connections and send back whatever each client sends"),
    ("producer-consumer example", "one producer and two consumers sharing a bounded queue with threads"),
    ("thread pool", "a fixed pool of worker threads that runs submitted jobs"),
    ("parallel sum", "sum a large array by splitting it across several threads"),
    ("rate limiter", "a token bucket that allows a number of events per second"),
    ("retry-with-backoff helper", "retry a failing operation with exponential backoff and a limit"),
    ("timer", "measure how long a function takes and print it in milliseconds"),
    ("event emitter", "register listeners by event name and emit events to them"),
    ("observer pattern example", "subjects that notify registered observers of changes"),
    ("singleton", "a thread-safe singleton configuration object"),
    ("builder pattern example", "build an object with many optional fields step by step"),
    ("state machine", "a traffic light that moves between states on a timer event"),
    ("shape hierarchy", "shapes with area and perimeter through an interface or base class"),
    ("2D vector type", "a 2D vector type with addition, scaling, dot product and length"),
    ("complex number type", "a complex number type with arithmetic and formatting"),
    ("fraction type", "fractions kept in lowest terms with the four operations"),
    ("big integer adder", "add two non-negative integers given as decimal strings"),
    ("base converter", "convert numbers between bases 2, 8, 10 and 16"),
    ("bit counter", "count the set bits of an integer in two different ways"),
    ("matrix determinant function", "the determinant of a square matrix by Gaussian elimination"),
    ("linear regression fit", "fit a line to points by least squares and print slope and intercept"),
    ("statistics helper", "mean, median, mode and standard deviation of a list of numbers"),
    ("random password generator", "make passwords of a given length from letters, digits and symbols"),
    ("UUID-like id generator", "generate random 128-bit ids formatted in hex groups"),
    ("date difference calculator", "the number of days between two dates given as YYYY-MM-DD"),
    ("leap year lister", "list the leap years between two years"),
    ("calendar printer", "print the calendar of a month for a given year"),
    ("stopwatch", "start, stop, lap and reset a stopwatch and print the laps"),
    ("countdown timer", "count down from a number of seconds and print each second"),
    ("inventory system", "add, remove and list products with quantities and prices"),
    ("student grades", "store students' grades and print each average and the class average"),
    ("library system", "books that can be checked out and returned by members"),
    ("shopping cart", "add items, change quantities, apply a discount and print the total"),
    ("parking lot", "assign and free parking spots of different sizes"),
    ("elevator simulation", "move an elevator between floors to serve requests in order"),
    ("bank queue simulation", "simulate customers arriving and tellers serving them"),
    ("maze solver", "find a path through a grid maze with BFS and print it"),
    ("N-Queens solver", "place N queens on an N by N board so that none attack each other"),
    ("sudoku solver", "solve a 9x9 sudoku by backtracking"),
    ("permutation generator", "print every permutation of a list"),
    ("subset generator", "print every subset of a set"),
    ("knapsack solver", "the 0/1 knapsack problem by dynamic programming"),
    ("longest common subsequence function", "the LCS of two strings and its length"),
    ("edit distance function", "the Levenshtein distance between two strings"),
    ("coin change solver", "the fewest coins that make an amount"),
    ("two-sum solver", "find two numbers of an array that add up to a target"),
    ("sliding window maximum routine", "the maximum of every window of size k in an array"),
    ("spiral matrix printer", "print a matrix in spiral order"),
    ("array rotation routine", "rotate an array by k positions in place"),
    ("interval merger", "merge overlapping intervals of a list"),
    ("bracket balance checker", "check that the brackets of an expression are balanced"),
    ("expression evaluator", "evaluate arithmetic expressions with + - * / and parentheses"),
    ("infix to postfix converter", "convert infix expressions to postfix with the shunting-yard algorithm"),
    ("tokenizer", "split source text into numbers, identifiers, operators and strings"),
    ("calculator REPL", "read expressions line by line and print their values"),
    ("Markdown to HTML converter", "convert headings, bold, italics and lists of Markdown to HTML"),
    ("URL parser", "split a URL into scheme, host, port, path, query and fragment"),
    ("email validator", "check whether strings look like valid email addresses"),
    ("text wrapper", "wrap a paragraph to a given line width without breaking words"),
    ("string compression routine", "compress repeated characters and keep the shorter result"),
    ("key-value store", "an in-memory key-value store with get, set, delete and expiry"),
    ("config loader", "load settings from a file and environment variables with defaults"),
    ("logger", "a logger with levels, timestamps and output to a file"),
    ("unit conversion table printer", "print a table converting kilometres to miles"),
    ("multiplication table printer", "print a formatted multiplication table up to 12"),
    ("bouncing ball", "simulate a ball bouncing in a box and print its positions"),
    ("dice roller", "roll dice given as NdM and print the total and each roll"),
    ("deck of cards", "build, shuffle and deal a deck of playing cards"),
    ("hangman", "a console hangman game with a small word list"),
    ("Snake game core", "the grid, movement, growth and collision rules of Snake"),
    ("bloom filter", "a Bloom filter with k hash functions, add and might-contain"),
    ("circular buffer", "a fixed-size circular buffer that overwrites the oldest entries"),
    ("sparse matrix", "a sparse matrix stored as a map with get, set and multiplication by a vector"),
    ("memoization helper", "a generic wrapper that caches the results of a pure function"),
    ("file copy tool", "copy a file in chunks and report the bytes copied"),
    ("checksum tool", "compute the CRC32 or a simple checksum of a file"),
    ("base64 codec", "encode and decode base64 without a library"),
    ("SHA-256 hashing example", "hash a string with the standard library and print the hex digest"),
    ("small tested function", "a small function with a handful of unit tests for it"),
)

TASK_ASKS = (
    "Write {a_task} in {lang}: {what}.",
    "Implement {a_task} in {lang}. It should {what_verb}",
    "Show me a {lang} program for this: {what}.",
    "How would I write {a_task} in {lang}? {what_cap}.",
    "Create {a_task} in {lang} with a main that shows it working. {what_cap}.",
    "Can you code {a_task} in {lang}? I need {what}.",
)
TASK_TAILS = ("", " Only code, please.", " Keep it short.", " Explain the idea first, then give the code.",
              " Add comments where it helps.", " Include a short example of its output.")
TASK_LANGUAGES = ("Python", "C", "C++", "Rust", "Go", "JavaScript", "Java", "TypeScript")
TASK_SYSTEMS = (None, "You are a helpful assistant.", "You are a careful senior software engineer.",
                "Answer with code only, no explanations.", "You are a concise assistant for programmers.")
# Words no request may contain (the benchmark's and the independent check's asks).
EXCLUDED = ("quicksort", "quick sort", "lru", "stack", "packages")


def _order(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _with_article(noun: str) -> str:
    return ("an " if noun[0].lower() in "aeio" or noun.startswith(("HTTP", "INI")) else "a ") + noun


def task_requests() -> Iterator[list[dict]]:
    """Every (task, language) pair once, in a fixed pseudo-random order, with the phrasing, tail
    and system prompt varying along the order."""
    pairs = sorted(((t, lang) for t in range(len(TASKS)) for lang in TASK_LANGUAGES),
                   key=lambda p: _order(f"{TASKS[p[0]][0]}|{p[1]}"))
    for k, (t, lang) in enumerate(pairs):
        task, what = TASKS[t]
        ask = TASK_ASKS[k % len(TASK_ASKS)]
        user = ask.format(a_task=_with_article(task), lang=lang, what=what, what_cap=what[0].upper() + what[1:],
                          what_verb=f"do this: {what}.")
        user += TASK_TAILS[(k // len(TASK_ASKS)) % len(TASK_TAILS)]
        system = TASK_SYSTEMS[(k // 3) % len(TASK_SYSTEMS)]
        yield ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
