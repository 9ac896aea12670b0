//! A small built-in English text from which the synthetic tokenizer learns its first BPE
//! merges, so that ordinary text encodes into plausible multi-byte tokens. Written for this
//! project; any English prose would do.

pub const CORPUS: &str = "\
The river runs past the old mill and under the stone bridge before it reaches the town. In the \
morning the water is cold and clear, and the people who live along its banks walk down to the \
edge to watch the light come over the hills. Children throw small stones and count the rings \
that spread across the surface. Their parents talk about the weather, the market, the price of \
bread and the news from the city.

A train leaves the station at seven each day. It carries letters, parcels, tools and a few \
travellers who have business in the north. The driver knows every curve of the line and every \
signal along the way. When the snow falls in winter he starts an hour earlier, because the \
track must be cleared and the engine must be warmed before it can pull its load up the long \
grade to the pass.

The school stands at the top of the hill. There are three rooms, a library with a thousand \
books, and a garden where the students grow beans, onions, carrots and potatoes. The teacher \
asks them to write down what they observe: how tall the plants have grown, how much rain has \
fallen, which insects visit the flowers. At the end of the year they compare their notes and \
draw a chart on the wall. Some years are dry and some are wet, but the garden always gives \
them something to eat.

In the workshop behind the school an engineer builds machines that measure the wind. Each \
machine has a small wheel, a counter and a clock. The wheel turns faster when the wind is \
strong, and the counter records how many times it turns in one minute. The engineer reads the \
numbers every evening and sends them to the weather office in the capital. Over many years \
these numbers have shown that the storms arrive earlier in the autumn than they used to.

Computers now do much of this work. A program reads the counters, stores the values in a \
table and draws a graph that anyone can open on a screen. The program was written by a \
student who learned to code in the library. She wanted to know whether the river would flood \
in the spring, so she collected the height of the water at the bridge for ten years and \
trained a model to predict it from the snow on the mountains and the temperature in March. \
The model is not perfect, but it has been right more often than it has been wrong, and the \
town council now asks her for a forecast before they decide where to place the sand bags.

Language is a kind of machine as well. Words are built from smaller parts, and the parts that \
appear most often are the ones a reader recognises first. A tokenizer learns these parts by \
counting pairs of symbols in a large text and joining the most frequent pair into a new \
symbol, again and again, until it has as many symbols as it needs. The result is a table of \
ranks: the lower the rank, the earlier the pair was joined. To encode a new sentence, the \
tokenizer starts from single bytes and repeatedly joins the neighbouring pair with the lowest \
rank until no pair in the table remains.

The evening is quiet. The shops close, the lamps are lit, and the smell of soup and fresh \
bread drifts from the kitchens. Somebody plays a violin near the fountain; a dog barks at a \
cat on a wall; two old friends play a slow game of chess under the trees. Tomorrow the train \
will leave at seven again, the wheel will turn in the wind, and the river will keep running \
past the mill toward the sea, as it has done for a very long time.

Questions for the reader: What would you measure if you had a counter and a clock? How would \
you know whether your model is right? Which words in this text are the most common, and why \
do you think that is? Write your answers in the margin, compare them with a friend, and then \
read the story once more.
";
