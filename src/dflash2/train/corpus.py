"""Prompt corpora for self-distillation: an offline default, or the user's own prompts / text.

The default corpus needs no download and never contains our evaluation sets (HumanEval,
MT-Bench; a test checks it). *Code* prompts are signatures and docstrings of pure-Python
functions and public methods of the standard library, completed as raw text. *Chat* prompts are
instructions sent with the chat template, in eight families named after the kinds of request a
chat model meets (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities): task
templates x topics, role-play personas, and word problems, logic puzzles and short texts to
extract facts from, made up with a seeded random generator. The families are interleaved, so
that any prefix of the chat prompts is balanced across them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash2.errors import InvalidOptionError

Prompt = str | list[dict[str, str]]

_MODULES = (
    "textwrap", "string", "shlex", "fnmatch", "glob", "heapq", "bisect", "statistics", "fractions",
    "colorsys", "calendar", "difflib", "html", "base64", "ipaddress", "json", "csv", "configparser",
    "argparse", "dataclasses", "functools", "operator", "copy", "pprint", "random", "secrets", "uuid",
    "urllib.parse", "email.utils", "posixpath", "ntpath", "pathlib", "tempfile", "shutil", "zipfile",
    "tarfile", "gettext", "locale", "codecs", "quopri", "uu", "wave", "tokenize", "ast", "dis",
    "inspect", "typing", "enum", "graphlib", "sched", "queue", "threading", "logging", "datetime",
    "zoneinfo", "decimal", "numbers", "cmath", "contextlib", "abc", "reprlib", "keyword", "traceback",
    "warnings", "mimetypes", "netrc", "smtplib", "http.cookies", "xml.dom.minidom", "plistlib",
    "collections", "re", "os", "types", "weakref", "getopt", "optparse", "cmd", "code", "codeop", "timeit",
    "trace", "platform", "sysconfig", "mailbox", "email.message", "email.header", "email.headerregistry",
    "email.policy", "http.client", "http.server", "http.cookiejar", "urllib.request", "urllib.robotparser",
    "ftplib", "poplib", "imaplib", "socketserver", "socket", "ssl", "selectors", "subprocess", "hmac",
    "getpass", "xml.etree.ElementTree", "xml.sax.saxutils", "xml.sax.handler", "html.parser", "json.decoder",
    "json.encoder", "xmlrpc.client", "xmlrpc.server", "wsgiref.util", "wsgiref.headers", "bdb", "pdb",
    "pstats", "pydoc", "doctest", "unittest.case", "unittest.mock", "filecmp", "fileinput", "linecache",
    "zipapp", "pkgutil", "runpy", "gzip", "bz2", "lzma", "shelve", "pickletools", "pyclbr", "symtable",
    "compileall", "logging.handlers", "logging.config", "asyncio.events", "asyncio.locks", "asyncio.queues",
    "asyncio.streams", "asyncio.tasks",
)  # fmt: skip

# standard-library functions and methods that share a name with a HumanEval entry point stay out
_EVALUATION_NAMES = frozenset((
    "Strongest_Extension", "add", "add_elements", "all_prefixes", "anti_shuffle", "any_int", "below_threshold",
    "below_zero", "bf", "by_length", "can_arrange", "car_race_collision", "change_base", "check_dict_case",
    "check_if_last_char_is_a_letter", "choose_num", "circular_shift", "closest_integer", "common", "compare",
    "compare_one", "concatenate", "correct_bracketing", "count_distinct_characters", "count_nums", "count_up_to",
    "count_upper", "cycpattern_check", "decimal_to_binary", "decode_cyclic", "decode_shift", "derivative",
    "digitSum", "digits", "do_algebra", "double_the_difference", "eat", "encode", "encrypt", "even_odd_count",
    "even_odd_palindrome", "exchange", "f", "factorize", "fib", "fib4", "fibfib", "file_name_check",
    "filter_by_prefix", "filter_by_substring", "filter_integers", "find_closest_elements", "find_max", "find_zero",
    "fix_spaces", "fizz_buzz", "flip_case", "fruit_distribution", "generate_integers", "get_closest_vowel",
    "get_max_triples", "get_odd_collatz", "get_positive", "get_row", "greatest_common_divisor",
    "has_close_elements", "hex_key", "histogram", "how_many_times", "incr_list", "int_to_mini_roman",
    "intersection", "intersperse", "is_bored", "is_equal_to_sum_even", "is_happy", "is_multiply_prime",
    "is_nested", "is_palindrome", "is_prime", "is_simple_power", "is_sorted", "iscube", "largest_divisor",
    "largest_prime_factor", "largest_smallest_integers", "longest", "make_a_pile", "make_palindrome",
    "match_parens", "max_element", "max_fill", "maximum", "mean_absolute_deviation", "median", "minPath",
    "minSubArraySum", "modp", "monotonic", "move_one_ball", "multiply", "next_smallest", "numerical_letter_grade",
    "odd_count", "order_by_points", "pairs_sum_to_zero", "parse_music", "parse_nested_parens", "pluck",
    "prime_fib", "prime_length", "prod_signs", "remove_duplicates", "remove_vowels", "rescale_to_unit",
    "reverse_delete", "right_angle_triangle", "rolling_max", "rounded_avg", "same_chars", "search",
    "select_words", "separate_paren_groups", "simplify", "skjkasdkd", "smallest_change", "solution", "solve",
    "sort_array", "sort_even", "sort_numbers", "sort_third", "sorted_list_sum", "specialFilter",
    "special_factorial", "split_words", "starts_one_ends", "strange_sort_list", "string_sequence",
    "string_to_md5", "string_xor", "strlen", "sum_product", "sum_squares", "sum_to_n", "total_match", "tri",
    "triangle_area", "triples_sum_to_zero", "truncate_number", "unique", "unique_digits", "valid_date",
    "vowels_count", "will_it_fly", "words_in_sentence", "words_string", "x_or_y",
))  # fmt: skip

# chat task templates on a {topic}, by the kind of request
_TASKS: dict[str, tuple[str, ...]] = {
    "writing": (
        "Write a short poem about {topic}.",
        "Write a short story that involves {topic}.",
        "Write an email to a friend recommending {topic}.",
        "Write the opening paragraph of a blog post about {topic} for complete beginners.",
        "Write a product description for a new gadget that has to do with {topic}.",
        "Write a two-minute speech about {topic} for a school assembly.",
        "Write a persuasive paragraph arguing that everyone should learn a little about {topic}.",
        "Write a formal email to the local council proposing a weekend event about {topic}.",
        "Write a catchy slogan and a three-sentence advertisement about {topic}.",
        "Give three practical tips about {topic}.",
    ),
    "reasoning": (
        "What questions should someone ask before getting started with {topic}?",
        "What would likely happen if {topic} suddenly disappeared from the world? Reason step by step.",
        "Someone says that time spent on {topic} is wasted. What assumptions lie behind that claim? Are they sound?",
        "Compare {topic} with something similar and explain the differences.",
        "A small town wants to spend money on {topic}. List the trade-offs it should weigh before deciding.",
    ),
    "math": (
        "Make up a short word problem about {topic} that needs multiplication, then solve it step by step.",
        "Give an example of how percentages or ratios come up in {topic}, with a worked calculation.",
    ),
    "coding": (
        "Write a Python function related to {topic} and explain how it works.",
        "Write a small Python class that models {topic}, with a few methods and docstrings.",
        "Design a SQL table to store information about {topic} and write two example queries against it.",
    ),
    "stem": (
        "Explain {topic} to a beginner in a few sentences.",
        "Explain the science behind {topic} in simple terms.",
        "Describe a simple experiment a student could do at home to learn something about {topic}.",
        "How do scientists or engineers measure the things that matter in {topic}?",
        "What role does energy play in {topic}?",
        "List five interesting facts about {topic}.",
        "What are common misconceptions about {topic}, and what is actually true?",
    ),
    "humanities": (
        "Summarize the history of {topic} in one paragraph.",
        "In what ways have culture and society been shaped by {topic} over time?",
        "What ethical questions come up around {topic}?",
        "How do attitudes toward {topic} differ between countries or cultures?",
        "What are the pros and cons of {topic}?",
        "How might {topic} change over the next twenty years, and why?",
        "Describe a typical day of a person who works with {topic}.",
    ),
}
_TOPICS = (
    # everyday life and hobbies
    "gardening", "sourdough bread", "public transport", "budget travel", "houseplants", "electric bikes",
    "time management", "recycling", "coffee brewing", "marathon training", "board games", "knitting",
    "mountain hiking", "saving money", "healthy breakfasts", "remote work", "city parks", "libraries", "origami",
    "camping", "first aid", "street food", "tea ceremonies", "podcasts", "composting", "sleep", "meditation",
    "birdwatching", "rock climbing", "moving to a new city", "job interviews", "public speaking", "journaling",
    "minimalism", "pet adoption", "dog training", "beekeeping", "woodworking", "bicycle repair", "fishing",
    "kayaking", "photography", "learning to swim", "baking cakes", "fermenting vegetables", "thrift shopping",
    "volunteering", "community gardens", "learning a new language", "chess openings", "video game design",
    # nature and science
    "volcanoes", "the water cycle", "birds of prey", "ocean tides", "honey bees", "rain forests", "dinosaurs",
    "the human heart", "vaccines", "photosynthesis", "weather forecasts", "earthquakes", "coral reefs",
    "black holes", "comets", "glaciers", "deserts", "whale migration", "octopuses", "mushrooms",
    "the immune system", "DNA", "antibiotics", "the periodic table", "magnets", "static electricity", "rainbows",
    "sound waves", "lightning", "clouds", "soil erosion", "wetlands", "tardigrades", "the northern lights",
    "telescopes", "microscopes", "plate tectonics", "fossils", "the nitrogen cycle", "natural selection",
    "the human brain", "muscles", "caffeine", "ants", "wolves", "sea turtles", "bamboo", "wind turbines",
    "solar panels", "nuclear power", "batteries", "hydrogen fuel", "desalination", "the speed of light",
    # computing and technology
    "binary search", "sorting algorithms", "hash tables", "version control", "unit testing", "regular expressions",
    "linked lists", "recursion", "SQL joins", "web servers", "spreadsheets", "password managers",
    "open-source software", "compilers", "operating systems", "computer networks", "encryption", "QR codes",
    "GPS", "3D printing", "robotics", "smartphones", "cloud storage", "databases", "web APIs", "caching",
    "garbage collection", "floating-point numbers", "the command line", "spam filters", "search engines",
    "recommendation systems", "barcodes", "image compression", "Wi-Fi", "data visualization", "code reviews",
    "web accessibility",
    # numbers
    "prime numbers", "probability", "compound interest", "maps and navigation", "fractions", "circles",
    "statistics in sports", "symmetry", "infinity", "logarithms", "magic squares", "estimation",
    "units of measurement", "leap years", "tessellations",
    # history, arts and culture
    "the Roman aqueducts", "the printing press", "the moon landing", "lighthouses", "bridges", "museums",
    "trains", "jazz music", "the Silk Road", "ancient Egypt", "the Renaissance", "the Industrial Revolution",
    "the telephone", "medieval castles", "the Olympic Games", "folk tales", "opera", "street art",
    "classical music", "chocolate", "the invention of writing", "the Vikings", "the Great Wall of China",
    "the Maya civilization", "mythology", "Shakespeare's plays", "newspapers", "democracy", "public holidays",
    "cathedral architecture", "calligraphy", "the history of money", "Stonehenge", "the Age of Exploration",
    "women's suffrage", "the space race", "comic books", "silent films", "folk dance", "theater", "pottery",
    "dialects", "translation", "table manners around the world", "harvest festivals", "libraries of antiquity",
    # society, work and money
    "inflation", "small businesses", "taxes", "supply chains", "urban planning", "social media",
    "online privacy", "advertising", "tourism", "part-time jobs", "electric cars", "fast fashion", "food waste",
    "plastic pollution", "fair trade", "the four-day work week", "online learning", "homeschooling",
    "retirement savings", "insurance", "credit cards", "housing costs", "car sharing", "air travel",
    "news media", "local elections",
    # health
    "hydration", "posture at a desk", "allergies", "screen time", "stretching", "vegetarian diets",
    "dental care", "stress", "daily walks", "sunscreen", "hearing protection",
)  # fmt: skip

# role play: a persona, then a request on a topic
_ROLES = (
    "a ship captain", "a medieval blacksmith", "a museum tour guide", "a kindergarten teacher", "a detective",
    "a personal trainer", "a travel agent", "a chef in a busy restaurant", "a park ranger",
    "an astronaut on a space station", "a librarian", "a pirate", "a wise old wizard", "a sports commentator",
    "a customer support agent", "a nutritionist", "a car mechanic", "a film critic", "a startup founder",
    "a news reporter", "a stand-up comedian", "a history professor", "a zookeeper", "a lighthouse keeper",
    "a time traveler from the year 2300", "a robot learning about humans", "a friendly dragon", "a farmer",
    "a pharmacist", "a real estate agent", "a poet from the nineteenth century", "a barista",
    "a mountain guide", "a job recruiter", "a game show host", "a marine biologist", "a carpenter",
    "a cat who can talk", "a radio DJ", "an archaeologist",
)  # fmt: skip
_ROLE_TASKS = (
    "Pretend you are {role}. Someone asks what you think about {topic}. Answer in character.",
    "You are {role}. Give a short welcome speech to newcomers that mentions {topic}.",
    "Stay in character as {role} and describe where you come across {topic} in your everyday life.",
    "Act as {role}. A curious child asks you to explain {topic}. What do you say?",
    "Imagine you are {role} writing a diary entry at the end of a day that had to do with {topic}.",
    "Take on the persona of {role} and give three pieces of advice about {topic}.",
    "As {role}, write a short letter to a friend about {topic}, using the vocabulary of your trade.",
    "You are {role} being interviewed on the radio, and the host asks about {topic}. Reply in character.",
)

# coding: small programs unlike the evaluation tasks
_CODE_TASKS = (
    "parses a duration such as '2h15m' into a number of seconds",
    "merges overlapping (start, end) intervals in a list",
    "flattens a nested dictionary into a dictionary with dotted keys",
    "converts temperatures between Celsius and Fahrenheit",
    "groups a list of words into families of anagrams",
    "counts the lines, words and characters of a text file",
    "checks whether a string is a well-formed IPv4 address",
    "converts a snake_case identifier to camelCase",
    "reads a CSV file and returns the total of one numeric column",
    "implements a least-recently-used cache with a fixed capacity",
    "retries a failing function call with exponential backoff",
    "splits a list into batches of a given size",
    "formats a number of bytes as a human-readable size such as '3.2 MB'",
    "finds duplicate files in a folder by comparing their hashes",
    "implements a queue with two stacks",
    "runs a breadth-first search on a graph stored as an adjacency list",
    "finds the shortest path through a maze given as a grid of walls and open cells",
    "computes the edit distance between two words",
    "transposes a matrix stored as a list of lists",
    "masks all but the last four digits of a card number",
    "generates a random password with letters, digits and symbols",
    "parses a URL query string into a dictionary",
    "checks whether two axis-aligned rectangles overlap",
    "rotates a square matrix by 90 degrees clockwise",
    "serializes a binary tree to a string and rebuilds it from that string",
    "validates a card number with the Luhn checksum",
    "removes repeated records from a list of dictionaries by a key, keeping the first of each",
    "prints a list of rows as a text table with aligned columns",
    "computes the total price of a shopping cart with per-item discounts",
    "turns a Markdown heading line into an HTML heading tag",
    "orders tasks so that every task comes after the tasks it depends on",
    "implements a token-bucket rate limiter",
    "parses a log line into its timestamp, level and message",
    "merges two dictionaries of counts, adding up the values of shared keys",
    "simulates many rolls of two dice and reports how often each total occurs",
    "implements a traffic light as a small state machine",
    "loads a JSON configuration file and fills in default values for missing keys",
    "compresses a string with run-length encoding and decodes it again",
    "lists every file with a given extension in a folder tree",
    "implements a binary min-heap from scratch",
    "evaluates an arithmetic expression written in reverse Polish notation",
    "checks whether a filled-in sudoku grid is valid",
    "builds a trie and uses it to list all words with a given prefix",
    "converts an RGB color to a hexadecimal color code and back",
    "returns one page of results given a page number and a page size",
    "computes the angle between the hour and minute hands of a clock",
    "advances Conway's Game of Life by one generation",
    "converts a number of seconds into a 'hh:mm:ss' string",
    "reads a text file and reports the longest line and its line number",
    "schedules meetings in a list of free time slots",
    "implements a simple bank account class with deposits, withdrawals and a statement",
    "parses a simple INI-style configuration text into nested dictionaries",
)  # fmt: skip
_CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a {language} function that {task}. Add comments that explain each step.",
    "Explain how you would write a program that {task}, then give the code in {language}.",
    "Write pytest unit tests for a Python function that {task}.",
    "Here is a task: write code that {task}. What edge cases should the solution handle? Then write it in Python.",
    "Write a Python function that {task}, and state its time complexity.",
)
_LANGUAGES = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C#", "Kotlin", "Ruby", "C")

# names, places and things for word problems, puzzles and texts to extract facts from
_NAMES = (
    "Ava", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Isabel", "Jonas", "Kemi", "Liam", "Maya",
    "Nikolai", "Olivia", "Pedro", "Quinn", "Rosa", "Samir", "Tara", "Umar", "Vera", "Wei", "Ximena", "Yusuf",
    "Zoe", "Amara", "Bruno", "Carmen", "Dev", "Esther", "Felix", "Greta", "Hassan", "Ingrid", "Jun", "Kofi",
    "Lena", "Mateo", "Nadia",
)  # fmt: skip
_SURNAMES = (
    "Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Novak", "Castillo", "Brennan", "Kowalski", "Mensah",
    "Ferreira", "Iyer", "Larsen", "Petrov", "Adeyemi", "Romano", "Schultz", "Nakamura", "Oliveira", "Quigley",
)  # fmt: skip
_CITIES = (
    "Lisbon", "Nairobi", "Osaka", "Toronto", "Lyon", "Krakow", "Melbourne", "Bogota", "Hanoi", "Oslo",
    "Marrakesh", "Valparaiso", "Tbilisi", "Glasgow", "Dublin", "Accra", "Seville", "Busan", "Perth", "Tallinn",
    "Monterrey", "Porto", "Cebu", "Zurich", "Antwerp", "Quito", "Izmir", "Bergen", "Adelaide", "Kyoto",
)  # fmt: skip
_JOBS = (
    "nurse", "software developer", "electrician", "architect", "baker", "accountant", "pilot", "translator",
    "veterinarian", "plumber", "journalist", "lab technician", "graphic designer", "teacher", "tailor",
)  # fmt: skip
_COMPANIES = (
    "Bluefin Labs", "Northwind Foods", "Copperleaf Design", "Helio Motors", "Tidewater Logistics",
    "Pinecrest Books", "Quartz Analytics", "Redwood Clinics", "Silverline Rail", "Lumen Textiles",
    "Oakridge Tools", "Harbor & Vine", "Kestrel Games", "Mosaic Media", "Granite Bank",
)  # fmt: skip
_PRODUCTS = (
    "a folding e-bike", "a smart kettle", "a noise-cancelling headset", "a solar lantern", "a standing desk",
    "a cordless drill", "a travel backpack", "a fitness tracker", "a cast-iron skillet", "a robot vacuum",
    "an e-reader", "a camping stove", "a mechanical keyboard", "a water filter", "a pair of trail shoes",
)  # fmt: skip
_ITEMS = (
    ("notebooks", 2, 9), ("apples", 1, 3), ("movie tickets", 8, 18), ("bus passes", 3, 12), ("pencils", 1, 2),
    ("bags of rice", 4, 15), ("plant pots", 3, 11), ("concert tickets", 25, 90), ("T-shirts", 7, 25),
    ("loaves of bread", 2, 6), ("board games", 15, 45), ("paint brushes", 2, 8),
)  # fmt: skip
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
)  # fmt: skip
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_EVENTS = (
    "book fair", "robotics contest", "food festival", "chess tournament", "charity run", "film festival",
    "science fair", "jazz concert", "farmers' market", "coding workshop",
)  # fmt: skip
# (a group, things that belong to it) for odd-one-out puzzles
_GROUPS = (
    ("fruits", ("apple", "pear", "mango", "plum", "cherry", "kiwi")),
    ("musical instruments", ("violin", "flute", "drum", "trumpet", "cello", "harp")),
    ("planets", ("Mars", "Venus", "Jupiter", "Saturn", "Neptune", "Mercury")),
    ("tools", ("hammer", "wrench", "saw", "screwdriver", "chisel", "pliers")),
    ("colors", ("crimson", "teal", "amber", "violet", "indigo", "olive")),
    ("birds", ("sparrow", "eagle", "heron", "pelican", "owl", "robin")),
    ("programming languages", ("Python", "Rust", "Haskell", "Kotlin", "Perl", "Lua")),
    ("rivers", ("Nile", "Danube", "Amazon", "Mekong", "Volga", "Rhine")),
)
_COMPARISONS = (
    ("taller", "shortest"), ("older", "youngest"), ("faster", "slowest"), ("heavier", "lightest"),
    ("richer", "poorest"), ("louder", "quietest"),
)  # fmt: skip
# (all X are Y, some Y are Z) premises for syllogisms
_SETS = (
    ("cats", "mammals", "pets"), ("roses", "flowers", "red things"), ("squares", "rectangles", "large shapes"),
    ("violinists", "musicians", "teachers"), ("salmon", "fish", "things that swim upstream"),
    ("oaks", "trees", "very old plants"), ("novels", "books", "bestsellers"), ("sedans", "cars", "electric vehicles"),
)  # fmt: skip


def _shopping(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    (item_a, low_a, high_a), (item_b, low_b, high_b) = rng.sample(_ITEMS, 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (
        f"{name} buys {a} {item_a} at ${rng.randint(low_a, high_a)} each and {b} {item_b} at "
        f"${rng.randint(low_b, high_b)} each. How much does {name} spend altogether? Show the working."
    )


def _discount(rng: random.Random) -> str:
    price, off = rng.randrange(20, 400, 5), rng.choice((10, 15, 20, 25, 30, 40, 50))
    return f"A coat costs ${price} and the shop takes {off}% off. What is the new price, and how much is saved?"


def _speed(rng: random.Random) -> str:
    hours = rng.randint(2, 7)
    km = hours * rng.randint(40, 120)
    vehicle = rng.choice(("train", "bus", "car", "ferry", "cyclist"))
    return f"A {vehicle} covers {km} km in {hours} hours. What is its average speed? How far does it go in 90 minutes?"


def _equation(rng: random.Random) -> str:
    a, x, b = rng.randint(2, 12), rng.randint(-15, 25), rng.randint(-40, 40)
    sign = "+" if b >= 0 else "-"
    return f"Solve the equation {a}x {sign} {abs(b)} = {a * x + b} for x and check the answer."


def _garden(rng: random.Random) -> str:
    width, length = rng.randint(3, 30), rng.randint(4, 45)
    return (
        f"A rectangular plot of land measures {width} m by {length} m. Find its area and its perimeter, "
        f"and say how many meters of fence would surround it."
    )


def _mean(rng: random.Random) -> str:
    values = [rng.randint(1, 99) for _ in range(rng.randint(5, 8))]
    return f"Compute the mean and the range of these numbers: {', '.join(map(str, values))}."


def _lcm(rng: random.Random) -> str:
    a, b = rng.randint(4, 60), rng.randint(4, 60)
    return (
        f"Two buses leave the station together; one comes back every {a} minutes, the other every {b} minutes. "
        f"After how long are both at the station together again?"
    )


def _fractions(rng: random.Random) -> str:
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    op = rng.choice(("add", "multiply", "subtract"))
    return f"{op.capitalize()} the fractions {a}/{b} and {c}/{d}, and write the result in lowest terms."


def _marbles(rng: random.Random) -> str:
    red, blue, green = rng.randint(1, 12), rng.randint(1, 12), rng.randint(0, 8)
    return (
        f"A jar holds {red} red, {blue} blue and {green} green marbles. If two marbles are drawn without putting "
        f"the first back, what is the chance that both are red?"
    )


def _interest(rng: random.Random) -> str:
    money, rate, years = rng.randrange(500, 20000, 100), rng.choice((2, 3, 4, 5, 6, 8)), rng.randint(2, 10)
    return f"${money} is saved at {rate}% interest a year, compounded yearly. What is the balance after {years} years?"


def _pipes(rng: random.Random) -> str:
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    return f"One hose fills a pool in {a} hours and a second one fills it in {b} hours. How long do both together take?"


def _ages(rng: random.Random) -> str:
    first, second = rng.sample(_NAMES, 2)
    younger, gap = rng.randint(3, 40), rng.randint(1, 30)
    return f"{first} is {gap} years older than {second}, and their ages add up to {2 * younger + gap}. How old is each?"


def _convert(rng: random.Random) -> str:
    value = rng.randint(3, 500)
    unit, target = rng.choice((
        ("kilometers", "miles"), ("pounds", "kilograms"), ("liters", "US gallons"), ("feet", "meters"),
        ("degrees Fahrenheit", "degrees Celsius"), ("square meters", "square feet"),
    ))  # fmt: skip
    return f"Convert {value} {unit} to {target}, and explain the conversion factor you use."


def _sequence(rng: random.Random) -> str:
    start, step, kind = rng.randint(1, 20), rng.randint(2, 9), rng.random()
    terms = [start * step**i for i in range(5)] if kind < 0.3 else [start + step * i for i in range(5)]
    return f"What are the next two numbers in {', '.join(map(str, terms))}, ...? Describe the rule."


def _recipe(rng: random.Random) -> str:
    people, more, grams = rng.randint(2, 6), rng.randint(3, 15), rng.randrange(100, 900, 25)
    return f"A recipe for {people} people needs {grams} g of flour. How much flour is needed to cook for {more} people?"


def _clock(rng: random.Random) -> str:
    hour, minute, length = rng.randint(9, 21), rng.randrange(0, 60, 5), rng.randint(75, 200)
    return f"A film starts at {hour}:{minute:02d} and runs for {length} minutes. At what time does it end?"


def _order_puzzle(rng: random.Random) -> str:
    more, most = rng.choice(_COMPARISONS)
    people = rng.sample(_NAMES, rng.randint(3, 5))
    facts = [f"{a} is {more} than {b}" for a, b in itertools.pairwise(people)]
    rng.shuffle(facts)
    return f"{'. '.join(facts)}. Who is the {most}? Explain how you worked it out."


def _syllogism(rng: random.Random) -> str:
    x, y, z = rng.choice(_SETS)
    return f"All {x} are {y}, and some {y} are {z}. Must some {x} be {z}? Explain your reasoning."


def _weekday(rng: random.Random) -> str:
    return f"If today is {rng.choice(_DAYS)}, what day of the week will it be in {rng.randint(3, 400)} days? Explain."


def _odd_one_out(rng: random.Random) -> str:
    (_, members), (_, others) = rng.sample(_GROUPS, 2)
    words = [*rng.sample(members, 3), rng.choice(others)]
    rng.shuffle(words)
    return f"Find the odd one out among {', '.join(words)}, and explain your choice."


def _knights(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    claim = rng.choice((
        f"'{b} is a liar.'", "'We are both liars.'", f"'{b} and I are different kinds.'",
        "'At least one of us tells the truth.'",
    ))  # fmt: skip
    return (
        f"On an island every person either always tells the truth or always lies. {a} says: {claim} "
        f"{b} says nothing. What can you conclude about {a} and {b}?"
    )


def _coins(rng: random.Random) -> str:
    coins = rng.choice((3, 8, 9, 12, 27))
    weight = rng.choice(("heavier", "lighter"))
    return (
        f"Among {coins} coins that look the same, one is slightly {weight}. With a balance scale, what is the "
        f"smallest number of weighings that always finds it? Describe the strategy."
    )


def _schedule(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    leave, walk, wait, ride = rng.randint(6, 9), rng.randint(5, 20), rng.randint(2, 15), rng.randint(10, 50)
    return (
        f"{name} leaves home at {leave}:{rng.randrange(0, 60, 5):02d}, walks {walk} minutes to the stop, waits "
        f"{wait} minutes and rides for {ride} minutes. Can {name} make a meeting at {leave + 1}:15? Reason it out."
    )


_MATH = (
    _shopping, _discount, _speed, _equation, _garden, _mean, _lcm, _fractions, _marbles, _interest, _pipes, _ages,
    _convert, _sequence, _recipe, _clock,
)  # fmt: skip
_PUZZLES = (_order_puzzle, _syllogism, _weekday, _odd_one_out, _knights, _coins, _schedule)


def _fact(rng: random.Random) -> str:
    name, city = f"{rng.choice(_NAMES)} {rng.choice(_SURNAMES)}", rng.choice(_CITIES)
    company, year, month = rng.choice(_COMPANIES), rng.randint(1995, 2024), rng.choice(_MONTHS)
    return rng.choice((
        f"{name}, a {rng.choice(_JOBS)} from {city}, joined {company} in {month} {year}.",
        f"{company} released {rng.choice(_PRODUCTS)} on {month} {rng.randint(1, 28)}, {year}, priced at "
        f"${rng.randint(20, 900)}.",
        f"About {rng.randrange(50, 5000, 10)} people came to the {rng.choice(_EVENTS)} in {city} on "
        f"{month} {rng.randint(1, 28)}, {year}.",
        f"In {year}, {company} earned ${rng.randint(2, 900)} million, {rng.randint(2, 40)}% more than the year before.",
        f"{name} traveled from {city} to {rng.choice([c for c in _CITIES if c != city])} in {month} and stayed for "
        f"{rng.randint(2, 21)} nights.",
        f"{name} paid ${rng.randint(15, 600)} for {rng.choice(_PRODUCTS)} at the {city} branch of {company}.",
    ))  # fmt: skip


_EXTRACTIONS = (
    "Extract every person mentioned in the text below, with the city linked to them, as a JSON list of objects.",
    "List all amounts of money that appear in the following text, from smallest to largest.",
    "From the following text, pull out each date and say what happened on it.",
    "Read the text below and build a Markdown table with one row per company and the facts given about it.",
    "Which cities are named in the following passage? Give each one once, in order of first appearance.",
    "Summarize the passage below in one sentence, then list every number it contains.",
    "Find all the years mentioned in the following text and sort them from earliest to latest.",
    "Turn the following text into a bulleted list of facts, one fact per bullet.",
    "Return CSV lines with the columns name, company and year for the people described below.",
    "Using only the text below, which event happened first, and when?",
)


def _extraction(rng: random.Random) -> str:
    facts = " ".join(_fact(rng) for _ in range(rng.randint(3, 5)))
    return f"{rng.choice(_EXTRACTIONS)}\n\n{facts}"


def _topic_family(rng: random.Random, templates: tuple[str, ...]) -> list[str]:
    pairs = list(itertools.product(templates, _TOPICS))
    rng.shuffle(pairs)
    return [task.format(topic=topic) for task, topic in pairs]


def _made_up(rng: random.Random, makers: tuple[Callable[[random.Random], str], ...], count: int) -> list[str]:
    return [makers[i % len(makers)](rng) for i in range(count)]


def _families(rng: random.Random) -> list[list[str]]:
    """One list of prompts per kind of request, each in a seeded random order."""
    roleplay = [
        task.format(role=role, topic=topic)
        for role, task in itertools.product(_ROLES, _ROLE_TASKS)
        for topic in rng.sample(_TOPICS, 4)
    ]
    coding = [
        template.format(task=task, language=rng.choice(_LANGUAGES))
        for task, template in itertools.product(_CODE_TASKS, _CODE_TEMPLATES)
    ]
    math = _made_up(rng, _MATH, 40 * len(_MATH))
    puzzles = _made_up(rng, _PUZZLES, 60 * len(_PUZZLES))
    extraction = _made_up(rng, (_extraction,), 600)
    for made in (roleplay, coding, math, puzzles):
        rng.shuffle(made)
    topical = {kind: _topic_family(rng, templates) for kind, templates in _TASKS.items()}
    return [
        topical["writing"],
        roleplay,
        [p for pair in itertools.zip_longest(puzzles, topical["reasoning"]) for p in pair if p is not None],
        [p for pair in itertools.zip_longest(math, topical["math"]) for p in pair if p is not None],
        [p for pair in itertools.zip_longest(coding, topical["coding"]) for p in pair if p is not None],
        extraction,
        topical["stem"],
        topical["humanities"],
    ]


def _signature_prompt(name: str, fn: Any) -> str | None:
    """``def name(args):`` + the first paragraph of the docstring, or None if ``fn`` does not qualify."""
    if name.startswith("_") or name in _EVALUATION_NAMES or not inspect.isfunction(fn):
        return None
    doc = inspect.cleandoc(fn.__doc__) if isinstance(fn.__doc__, str) else ""  # its own, not an inherited one
    if len(doc) < 40:
        return None
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    if " at 0x" in signature:  # a default that prints its address would differ from run to run
        return None
    summary = doc.split("\n\n")[0].strip().replace('"""', "'''").replace("\n", "\n    ")
    return f'def {name}{signature}:\n    """{summary}\n    """\n'


@functools.lru_cache(maxsize=1)
def stdlib_functions() -> tuple[tuple[str, Any], ...]:
    """(name, function) of the public pure-Python functions and methods of ``_MODULES``, in a fixed
    order, without the names of HumanEval's entry points."""
    found: list[tuple[str, Any]] = []
    for module_name in _MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, value in sorted(vars(module).items()):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            candidates: list[tuple[str, Any]]
            if inspect.isfunction(value):
                candidates = [(name, value)]
            elif inspect.isclass(value) and not name.startswith("_"):
                members = sorted(vars(value).items())
                candidates = [(n, m.__func__ if isinstance(m, (staticmethod, classmethod)) else m) for n, m in members]
            else:
                continue
            found += [
                (n, fn)
                for n, fn in candidates
                if not n.startswith("_") and n not in _EVALUATION_NAMES and inspect.isfunction(fn)
            ]
    return tuple(found)


@functools.lru_cache(maxsize=1)
def _code_prompts() -> tuple[str, ...]:
    prompts = (_signature_prompt(name, fn) for name, fn in stdlib_functions())
    return tuple(dict.fromkeys(p for p in prompts if p is not None))  # ordered, and without repeats


def code_prompts(limit: int | None = None) -> list[str]:
    """``def name(args):`` + docstring of standard-library functions and public methods, for raw completion."""
    prompts = list(_code_prompts())
    return prompts[:limit] if limit is not None else prompts


def chat_prompts(limit: int | None = None, seed: int = 0) -> list[list[dict[str, str]]]:
    """Single-turn instructions, made up and shuffled with ``seed``, the kinds of request taking turns."""
    families = _families(random.Random(seed))
    unique = dict.fromkeys(p for group in itertools.zip_longest(*families) for p in group if p is not None)
    prompts = [[{"role": "user", "content": content}] for content in unique]
    return prompts[:limit] if limit is not None else prompts


def default_corpus(size: int, seed: int = 0) -> list[Prompt]:
    """Code and chat prompts taking turns (chat alone once the code runs out), the first ``size``.

    A corpus is a prefix of every larger one, so a run grown with a larger ``--samples`` keeps its
    cached responses."""
    code = code_prompts()
    random.Random(seed).shuffle(code)
    chat = chat_prompts(seed=seed)
    out: list[Prompt] = []
    for a, b in itertools.zip_longest(code, chat):
        out += [p for p in (a, b) if p is not None]
        if len(out) >= size:
            break
    return out[:size]


def load_prompts(path: Path) -> list[Prompt]:
    """A ``.jsonl`` file: one ``{"prompt": str}`` or ``{"messages": [...]}`` per line."""
    prompts: list[Prompt] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise InvalidOptionError(f"cannot read the prompts file {path}: {err}") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidOptionError(f"{path}:{number} is not JSON: {err}") from err
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            prompts.append(record["messages"])
        else:
            raise InvalidOptionError(f'{path}:{number}: expected {{"prompt": "..."}} or {{"messages": [...]}}.')
    if not prompts:
        raise InvalidOptionError(f"{path} holds no prompts.")
    return prompts


def load_text(directory: Path, chunk_chars: int = 1200) -> list[str]:
    """Raw text files under ``directory`` (``*.txt``, ``*.md``, ``*.py``), cut into prompt-sized chunks."""
    if not directory.is_dir():
        raise InvalidOptionError(f"{directory} is not a directory of text files.")
    chunks: list[str] = []
    for file in sorted(p for p in directory.rglob("*") if p.suffix in (".txt", ".md", ".py") and p.is_file()):
        text = file.read_text(errors="ignore")
        chunks += [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars) if text[i : i + chunk_chars]]
    if not chunks:
        raise InvalidOptionError(f"no .txt, .md or .py text under {directory}.")
    return chunks
