"""Real prose for benchmark prompts, written for Conveyor (not copied from anywhere).

Prompts are cut from this text in model tokens (see `workloads.py`), so a benchmark
feeds the model ordinary English rather than random token ids: attention patterns,
tokenization and (for a server with prefix caching) cache behaviour are then those of
real traffic.

PASSAGES: paragraphs on varied topics, about 2,600 SmolLM2 tokens together.
SYSTEM_PROMPT: a long assistant brief (more than 400 tokens) shared by every request
    of the `shared-prefix` workload.
QUESTIONS: short user questions, paired with SYSTEM_PROMPT.
"""

from __future__ import annotations

PASSAGES: tuple[str, ...] = (
    "A river is never the same water twice, but it keeps its shape for centuries. The "
    "channel bends where the bank is soft and straightens where rock refuses to give way. "
    "On the outside of each bend the current runs fast and cuts into the bank; on the "
    "inside it slows and drops the sand and gravel it carried down from the hills. Over "
    "decades the bends wander across the valley floor like a slow snake, and old loops are "
    "left behind as crescent lakes when a flood takes a shorter path. Farmers who work the "
    "flood plain know that the soil is rich precisely because the river is restless: every "
    "high water leaves a thin layer of silt, and every field was once the bottom of the "
    "stream.",
    "Bread begins with four ingredients and a great deal of patience. Flour and water, "
    "left to rest together, form gluten: long elastic proteins that trap the gas made by "
    "yeast as it eats the sugars in the dough. A baker folds the dough rather than "
    "kneading it hard, stretching the strands and letting them relax again. Salt tightens "
    "the network and slows the yeast, which gives the flavour time to develop. The loaf is "
    "shaped, proofed until a gentle press with a finger springs back slowly, and slashed "
    "with a blade so that it opens where the baker chooses instead of bursting at the "
    "side. In a hot oven the trapped gas expands, the crust browns, and the kitchen fills "
    "with the smell that has drawn people to bakeries for thousands of years.",
    "Before the printing press, a book was copied by hand, and a careful scribe might "
    "finish a few pages a day. Movable metal type changed the arithmetic of knowledge. A "
    "compositor picked letters from a case, set them in a stick line by line, locked the "
    "page into a frame and inked it; a press could then make hundreds of identical sheets "
    "before the type was cleaned and sorted for the next job. Errors no longer multiplied "
    "from copy to copy, and a correction made once appeared in every sheet. Within a "
    "lifetime, pamphlets, almanacs, grammars and maps were cheap enough for merchants and "
    "artisans to own, and arguments that had once stayed inside a monastery travelled "
    "along trade routes to distant cities.",
    "A moving bicycle stays upright although it has only two narrow points of contact "
    "with the road. Part of the answer is steering: when the bike leans to one side, the "
    "front wheel turns toward the lean, bringing the wheels back under the rider's centre "
    "of mass. The geometry of the fork helps, because the point where the steering axis "
    "meets the ground lies ahead of the point where the tyre touches it, so the wheel "
    "tends to follow the direction of travel like a caster on a shopping trolley. Riders "
    "make thousands of small corrections without thinking about them. Children learning to "
    "ride discover that speed makes balance easier, and that looking far ahead works better "
    "than staring at the front wheel.",
    "Twice a day, on most coasts, the sea rises and falls. The moon pulls on the ocean "
    "nearest to it a little more strongly than on the earth as a whole, and on the far "
    "side it pulls a little less, so the water forms two gentle bulges that the planet "
    "turns beneath. The sun adds its own smaller pull: when sun and moon line up, at new "
    "and full moon, the tides are higher and lower than usual, and when they stand at right "
    "angles the range is small. Local geography then reshapes everything. In a long funnel "
    "shaped bay the water can rise by more than ten metres, while some enclosed seas barely "
    "notice the tide at all.",
    "A honeybee colony behaves like a single animal spread across tens of thousands of "
    "bodies. Young workers clean cells and feed larvae; older ones build comb, guard the "
    "entrance and finally fly out to forage. A forager that finds a rich patch of flowers "
    "returns and dances on the comb: the angle of her waggling run relative to vertical "
    "tells her sisters the direction of the food relative to the sun, and the length of "
    "the run tells them the distance. Nectar is passed from mouth to mouth, fanned by "
    "thousands of wings until most of its water evaporates, and sealed under wax as honey, "
    "a store that carries the colony through winter.",
    "Volcanoes are places where the planet's interior reaches the surface. Deep below, "
    "rock melts where pressure drops or where water lowers its melting point, and the "
    "lighter molten rock rises through cracks and gathers in chambers a few kilometres "
    "down. What happens next depends on how sticky the magma is and how much gas it holds. "
    "Runny basalt lets gas escape easily and flows out in glowing rivers, building broad "
    "shield volcanoes. Thick, silica rich magma traps its gas until the pressure wins, and "
    "then the eruption is explosive, hurling ash high into the sky. Observatories watch for "
    "small earthquakes, swelling ground and changes in the gases at vents to warn the "
    "towns on the slopes.",
    "Sending a letter across a continent once took weeks and passed through many hands. "
    "Post roads were divided into stages, with fresh horses and riders waiting at each "
    "station, so the mail moved day and night while any single rider covered only a short "
    "distance. Later, sorting clerks worked inside moving railway carriages, reading "
    "addresses by lamplight and dropping bundles at stations without the train stopping. "
    "Postage stamps made the sender pay in advance at a flat rate, which simplified the "
    "accounts enormously. Postal codes came later still, turning an address into a route "
    "that a machine could read, and today a parcel can be tracked from door to door.",
    "In chess the first dozen moves are a fight for the centre. A pawn on one of the four "
    "central squares controls space and gives the pieces behind it room to move, while "
    "knights and bishops are brought out quickly so that they can take part in the game. "
    "Castling tucks the king behind a wall of pawns and connects the rooks along the back "
    "rank. Opening theory records which moves have worked in practice, but strong players "
    "warn against memorising lines without understanding them: once the opponent leaves "
    "the book, only the principles remain, and a player who knows why a move is good can "
    "find a sensible reply on the board.",
    "Lighthouse keepers lived by routine. Every evening before dusk they climbed the "
    "spiral stairs, trimmed the wick or checked the mantle, and wound the clockwork that "
    "turned the great lens so that the beam swept the sea with its own pattern of flashes. "
    "Sailors identified each light by that pattern and by its colour, marked on their "
    "charts. Through the night the keeper logged the weather, watched for ships in "
    "trouble and kept the glass free of soot. In fog a horn sounded at fixed intervals. "
    "Most lights are automatic now, but the towers still stand on their headlands, and "
    "their logbooks are a precious record of a century of storms.",
    "Coffee grows best on steep tropical hillsides, in the shade of taller trees, where "
    "cool nights slow the ripening of the fruit. Each cherry holds two seeds, and pickers "
    "return to the same bush several times because the fruit does not ripen all at once. "
    "After picking, the seeds are freed from the pulp, either washed and fermented or "
    "dried inside the whole fruit in the sun, and each method leaves its mark on the "
    "taste. The green beans travel the world in sacks and are roasted close to where they "
    "will be drunk: a few minutes in a hot drum turns them brown and fragrant, and a few "
    "minutes too many turns them bitter.",
    "A map is an argument about what matters. To draw the curved surface of the earth on "
    "a flat sheet, a cartographer must stretch or tear it somewhere, and every projection "
    "chooses what to keep true: the shapes of coastlines, the sizes of countries, or the "
    "compass bearings a navigator needs. The familiar world map that keeps bearings "
    "straight makes lands near the poles look enormous. Scale, symbols and what is left "
    "out are choices too. A hiking map shows contour lines and springs; a road atlas hides "
    "the hills entirely. Reading a map well means knowing which questions it was drawn to "
    "answer.",
    "Rain that falls on a city behaves very differently from rain that falls on a forest. "
    "Roofs, roads and car parks let almost nothing soak in, so water rushes into gutters "
    "and drains within minutes, and a heavy storm can overwhelm pipes that were sized for "
    "a smaller town. Engineers now try to slow the water down: green roofs hold part of "
    "the rain, permeable paving lets it seep into gravel beds, and shallow planted basins "
    "in parks fill during storms and drain slowly afterwards. These measures also cool the "
    "streets in summer and give birds and insects small islands of habitat among the "
    "concrete.",
    "Jazz musicians improvise, but they rarely start from nothing. A tune provides a "
    "sequence of chords that repeats, and each player invents a melody that fits the "
    "harmony as it passes. Years of practice go into those moments: scales and patterns "
    "played in every key, phrases learned by ear from recordings, and an understanding of "
    "which notes create tension and which resolve it. On the bandstand the players listen "
    "to one another constantly. The drummer answers a phrase from the saxophone, the "
    "pianist leaves space for the bass, and a good solo feels like a conversation rather "
    "than a speech.",
    "Climbing a high mountain is mostly a problem of logistics and patience. Above a few "
    "thousand metres the air holds less oxygen, and the body needs days or weeks to adapt "
    "by making more red blood cells. Expeditions therefore climb high and sleep low, "
    "carrying loads up to a camp and returning to rest before moving higher. Weather "
    "decides the summit day: a window of calm between storms may last only a day or two. "
    "Experienced guides set a turnaround time before they leave camp and keep it even "
    "when the top is in sight, because most accidents happen on the way down, when "
    "climbers are tired and the light is fading.",
    "Glass is sand that has been persuaded to forget its crystals. Silica melts only at a "
    "very high temperature, so glassmakers add soda to lower the melting point and lime to "
    "keep the result from dissolving in water. When the melt cools quickly, its atoms "
    "have no time to arrange themselves into a regular lattice, and the solid keeps the "
    "disordered structure of a liquid. A glassblower gathers a glowing blob on the end of "
    "a hollow pipe, blows a bubble into it, and shapes it with wooden paddles and wet "
    "newspaper, reheating it again and again in the furnace. Finished pieces are cooled "
    "slowly in an oven so that stresses do not crack them.",
    "Until the railways arrived, every town kept its own time by the sun, and noon in one "
    "town came a few minutes after noon in the next town to the east. That was harmless "
    "when travel was slow, but a railway timetable listing dozens of local times invited "
    "confusion and, on single track lines, collisions. Railway companies adopted a common "
    "standard time for their whole network, telegraph lines carried time signals from "
    "observatories, and eventually nations agreed to divide the globe into zones a whole "
    "number of hours apart. Clocks on station platforms became the public reference that "
    "people set their watches by.",
    "A compost heap is a small ecosystem working for free. Bacteria start the job, "
    "breaking down soft kitchen scraps and grass clippings, and their activity heats the "
    "centre of the pile, sometimes enough to steam on a cold morning. Fungi tackle the "
    "tougher material such as straw and dead leaves, and worms, mites and beetles move in "
    "as the heap cools. The gardener's task is balance: green material supplies nitrogen, "
    "brown material supplies carbon, and the pile needs air and about as much moisture as "
    "a wrung out sponge. After some months the result is dark, crumbly and sweet smelling, "
    "ready to feed next year's vegetables.",
    "Each autumn millions of small birds leave their breeding grounds and fly thousands "
    "of kilometres to spend the winter somewhere warmer. Many travel at night, when the "
    "air is calm and cool and predators are fewer, and rest and feed during the day. They "
    "find their way with several compasses at once: the position of the setting sun, the "
    "pattern of stars around the celestial pole, and the earth's magnetic field, which "
    "some birds seem able to sense. Young birds on their first journey often fly alone "
    "and still reach the right region, which suggests that the direction and the rough "
    "distance are inherited.",
    "A public library is one of the quieter triumphs of civic life. Anyone may walk in, "
    "sit down and read without paying or explaining why. Behind the shelves, librarians "
    "catalogue each book so that it can be found by author, title and subject, and a "
    "classification number places works on related topics side by side, inviting the "
    "lucky discovery of a book one did not know to look for. Modern libraries lend films "
    "and tools, teach people to use computers, host reading groups for children and give "
    "job seekers a place to write applications. Their reading rooms remain among the few "
    "indoor spaces where nobody expects you to buy anything.",
)

SYSTEM_PROMPT: str = (
    "You are the help desk assistant of Riverside Community Workshop, a volunteer run "
    "space where neighbours repair bicycles, furniture, small appliances and clothing "
    "together. Your job is to answer questions from members and visitors clearly and "
    "kindly. Follow these guidelines in every answer. First, be practical: give concrete "
    "steps in the order a person would carry them out, and say which tools and materials "
    "each step needs. Second, be safe: whenever a repair involves mains electricity, gas, "
    "sharp blades, solvents or heavy lifting, say so plainly at the start, explain the "
    "precaution, and recommend booking a supervised session when the risk is real. Never "
    "suggest opening a microwave oven, a television with a tube, or anything connected to "
    "the gas supply. Third, be honest about limits: if a repair is unlikely to succeed or "
    "would cost more than a replacement, say so and suggest where the item can be "
    "recycled. Fourth, be brief: most answers should fit in a few short paragraphs, and a "
    "list is better than a wall of text when there are several steps. The workshop opens "
    "on Tuesday and Thursday evenings from six to nine, and on Saturday from ten in the "
    "morning until four in the afternoon. Members pay a small yearly fee, visitors may "
    "come twice before joining, and children under fourteen must be accompanied by an "
    "adult. The tool library lends drills, sanders, sewing machines, a pipe bender and a "
    "set of bicycle stands; items are lent for one week and may be renewed once. Spare "
    "parts donated by members are kept in labelled drawers near the entrance and are free "
    "to use for repairs done in the workshop. When a question is about opening hours, "
    "fees, lending rules or events, answer from these facts and do not invent new ones; "
    "if the facts here do not cover the question, say that a volunteer at the front desk "
    "can help. Always finish by inviting the person to drop in during opening hours if "
    "they would like someone to look at the item with them. Remember that many people "
    "who write to the help desk have never repaired anything before, so avoid jargon, "
    "explain any technical word the first time you use it, and encourage them: a "
    "first repair that goes well is the best reason to come back for a second one."
)

QUESTIONS: tuple[str, ...] = (
    "My bicycle chain keeps slipping when I pedal hard uphill. What should I check first?",
    "Can I borrow a sewing machine this weekend, and for how long?",
    "The leg of my kitchen chair wobbles. How do I fix a loose joint?",
    "My kettle stopped heating but the light still comes on. Is it worth repairing?",
    "How do I patch a small hole in the elbow of a wool jumper?",
    "What are your opening hours on Saturday?",
    "The zip on my winter coat has split below the slider. Can that be repaired?",
    "How do I true a slightly buckled bicycle wheel at home?",
    "Is it safe to replace the plug on a lamp myself?",
    "My wooden table has a white ring from a hot mug. How can I remove it?",
    "Can my twelve year old daughter come to the workshop on her own?",
    "How do I adjust bicycle brakes that rub on the rim?",
    "The handle of my favourite mug snapped off cleanly. Which glue should I use?",
    "What does membership cost and what does it include?",
    "My vacuum cleaner has lost suction. What are the usual causes?",
    "How do I replace a broken button so that it does not fall off again?",
)

__all__ = ["PASSAGES", "QUESTIONS", "SYSTEM_PROMPT"]
