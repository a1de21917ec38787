--[[
dsstage_submit.lua: submit-time checks of --dataset for slurmctld's job_submit/lua (Lua 5.1).

Call it from your site's job_submit.lua:

    package.path = "/etc/slurm/?.lua;" .. package.path
    -- pcall: a module that fails to load must not stop slurmctld (see job_submit.lua, which
    -- then refuses only the jobs that ask for a dataset)
    local loaded, dsstage = pcall(require, "dsstage_submit")
    -- the catalog `dsstage export-catalog` writes: /var/lib/dsstage/dsstage_catalog.lua

    function slurm_job_submit(job_desc, part_list, submit_uid)
        if not loaded then return slurm.SUCCESS end  -- or refuse a --dataset job, as job_submit.lua does
        local rc, msg = dsstage.check(job_desc, submit_uid, part_list)
        if rc ~= slurm.SUCCESS then
            slurm.log_user(msg)
            return rc
        end
        -- ... the site's own checks ...
        return slurm.SUCCESS
    end

check() rejects unknown datasets (with a suggestion), restricted datasets the user may not
use, and malformed or conflicting values; an accepted request is recorded in the job's
admin_comment as "dsstage=NAME[,NAME...]", which users cannot edit and dsstage reads back
from the queue. During a pilot (rollout.partitions), a job of another partition is checked
but neither recorded nor given a preference (or refused, with rollout.outside: refuse). The catalog is re-read when its file changes, so `dsstage export-catalog`
takes effect without restarting slurmctld.

This runs inside slurmctld, for every submission: it must never wait. It starts no program
and looks no user or group up (a slow directory service would stall every submission).
Who may use a restricted dataset comes from the catalog: `dsstage export-catalog` resolves
the dataset's groups into uids outside slurmctld, and a timer runs it again, so a group
change reaches this check when the catalog is next written. The Prolog on the node checks
the groups again with the node's own lookups and has the last word.
]]

local M = {}

-- The generated catalog: dsstage's own state directory, which configuration management
-- that owns /etc/slurm does not purge (the catalog timer writes it there). A loader may add
-- a place to look (job_submit.lua: the directory it is loaded from, where a development
-- cluster keeps its catalog); the first that exists is read. catalog_path, if set, is the only one.
M.catalog_search = { "/var/lib/dsstage/dsstage_catalog.lua" }
M.catalog_path = nil
M.value_max = 1024
M.name_max = 64

local cached, cached_key

local function file_key(path)
	-- Lua 5.1 has no stat(): the file's size and first line (its generation stamp) stand in
	local f = io.open(path, "r")
	if not f then return nil end
	local first = f:read("*l") or ""
	local size = f:seek("end")
	f:close()
	return first .. ":" .. tostring(size)
end

local function readable(path)
	local f = io.open(path, "r")
	if not f then return false end
	f:close()
	return true
end

-- The catalog file to read now: catalog_path, or the first of catalog_search that exists
-- (nil, and where it was looked for, when none does).
function M.catalog_file()
	if M.catalog_path then return M.catalog_path, M.catalog_path end
	for _, path in ipairs(M.catalog_search) do
		if readable(path) then return path, path end
	end
	return nil, table.concat(M.catalog_search, " or ")
end

local reported = false  -- slurmctld's log says once that the catalog is missing, not per job

function M.catalog()
	local path, where = M.catalog_file()
	local key = path and file_key(path)
	if key == nil then
		local msg = "dsstage: the dataset catalog " .. where .. " is missing, so no job may ask for a " ..
			"dataset; an admin must run `dsstage export-catalog -o " .. (M.catalog_path or M.catalog_search[1]) ..
			"` (the dsstage-catalog.timer does)"
		if not reported and type(slurm) == "table" and type(slurm.log_error) == "function" then
			slurm.log_error("%s", msg)
			reported = true
		end
		return nil, msg
	end
	reported = false
	if key ~= cached_key then
		local ok, cat = pcall(dofile, path)
		if not ok or type(cat) ~= "table" or type(cat.datasets) ~= "table" then
			return nil, "dsstage: the dataset catalog " .. path ..
				" is damaged; an admin must run `dsstage export-catalog`"
		end
		cached, cached_key = cat, key
	end
	return cached
end

-- The datasets named by burst-buffer directives in text (a job script, or --bb's value):
-- "#BB_LUA dataset=a,b" lines, joined with commas; nil if there is none, and nil and a
-- message for a #BB_LUA option dsstage does not know (the cluster's burst_buffer.lua is ours).
function M.bb_request(text)
	-- every submission's script passes here: most have no directive, and need no line scan
	if type(text) ~= "string" or not string.find(text, "#BB_LUA", 1, true) then return nil end
	local values = {}
	for line in string.gmatch(text .. "\n", "([^\n]*)\n") do
		local rest = string.match(line, "^#BB_LUA%s+(.*)$") or (line == "#BB_LUA" and "") or nil
		if rest then
			if not string.find(rest, "%S") then
				return nil, "dsstage: #BB_LUA with no option; write #BB_LUA dataset=NAME[,NAME...]"
			end
			for word in string.gmatch(rest, "%S+") do
				local key, value = string.match(word, "^([%w_]+)=(.*)$")
				if key ~= "dataset" then
					return nil, "dsstage: #BB_LUA " .. word .. ": unknown option; write #BB_LUA dataset=NAME[,NAME...]"
				end
				values[#values + 1] = value
			end
		end
	end
	if #values == 0 then return nil end
	return table.concat(values, ",")
end

-- The names the Prolog reads a --dataset request from (dsstage.fs.runfiles.REQUEST_VARS).
-- slurmd gives the Prolog each entry of the job's SPANK environment as SPANK_<name>, or
-- as it is when the name begins with SPANK_ already: a SPANK plugin of the user's own
-- (loaded from their own SLURM_CONF) could set the Prolog's variable directly.
local PROLOG_READS = { SPANK_DSSTAGE_DATASETS = true, SPANK__SLURM_SPANK_OPTION_dsstage_dataset = true }

-- The --dataset value from the job's SPANK environment (indexed from 0), or nil; nil and a
-- message for an entry that would reach the Prolog without passing this check.
local function requested(job_desc)
	local env = job_desc.spank_job_env
	if env == nil then return nil end
	local values = {}
	local i = (env[0] ~= nil) and 0 or 1  -- Slurm 22.05 indexes this table from 0
	while env[i] ~= nil do
		local k, v = string.match(env[i], "^([^=]*)=(.*)$")
		if k ~= nil and PROLOG_READS[k] then
			return nil, "dsstage: the job's SPANK environment sets " .. k .. ", which only Slurm may: a SPANK " ..
				"plugin other than dsstage's asks for datasets this check never saw; remove it from the " ..
				"plugstack your SLURM_CONF names and submit with --dataset=NAME"
		end
		if k == "DSSTAGE_DATASETS" or k == "_SLURM_SPANK_OPTION_dsstage_dataset" then
			values[#values + 1] = v
		end
		i = i + 1
	end
	if #values == 0 then return nil end
	for _, v in ipairs(values) do
		if v ~= values[1] then
			return nil, "dsstage: conflicting --dataset values in the job's environment; submit with one --dataset"
		end
	end
	return values[1]
end

local function distance(a, b)
	local prev = {}
	for j = 0, #b do prev[j] = j end
	for i = 1, #a do
		local cur = { [0] = i }
		for j = 1, #b do
			local cost = (a:sub(i, i) == b:sub(j, j)) and 0 or 1
			cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
		end
		prev = cur
	end
	return prev[#b]
end

local function suggest(name, datasets)
	local best, best_d
	for known, _ in pairs(datasets) do
		local d = distance(name, known)
		if (best_d == nil or d < best_d or (d == best_d and known < best)) then
			best, best_d = known, d
		end
	end
	if best ~= nil and best_d <= math.max(2, math.floor(#name / 3)) then
		return " (did you mean '" .. best .. "'?)"
	end
	return ""
end

function M.parse(value)
	if value == nil or string.match(value, "^%s*$") then
		return nil, "dsstage: --dataset is empty: name at least one dataset (see `dsstage ls`)"
	end
	if #value > M.value_max then
		return nil, "dsstage: --dataset value is " .. #value .. " characters long; at most " ..
			M.value_max .. " are accepted"
	end
	local names, seen = {}, {}
	for part in string.gmatch(value .. ",", "([^,]*),") do
		local name = string.match(part, "^%s*(.-)%s*$")
		if name == "" then
			return nil, "dsstage: --dataset=" .. value .. ": empty dataset name"
		end
		if #name > M.name_max or not string.match(name, "^[a-z0-9][a-z0-9._-]*$") then
			return nil, "dsstage: --dataset: dataset name '" .. name .. "' is not allowed: use lower-case " ..
				"letters, digits, '.', '_' and '-', starting with a letter or digit"
		end
		if not seen[name] then
			seen[name] = true
			names[#names + 1] = name
		end
	end
	return names
end

-- Whether uid may use ds: anyone for an unrestricted dataset; for a restricted one, root
-- and the uids the catalog lists. nil and a message when the catalog has no list for it.
local function may_use(name, ds, uid)
	if ds.groups == nil or uid == 0 then return true end
	if type(ds.uids) ~= "table" then
		return nil, "dsstage: the dataset catalog " .. (M.catalog_file()) .. " lists no users for '" .. name ..
			"'; an admin must run `dsstage export-catalog`"
	end
	return ds.uids[uid] == true
end

-- Why a recent group change may not show yet.
local function regenerated(cat)
	local when = "a timer runs it"
	if type(cat.generated) == "number" then
		when = when .. "; this catalog is from " .. os.date("!%Y-%m-%d %H:%M UTC", cat.generated)
	end
	return "; group changes take effect when `dsstage export-catalog` regenerates the catalog (" .. when .. ")"
end

-- slurm.SUCCESS, or slurm.ERROR and a one-line message for the user. part_list: what
-- slurm_job_submit is given (the default partition of a job that names none comes from it).
function M.check(job_desc, submit_uid, part_list)
	local value, err = requested(job_desc)
	if err then return slurm.ERROR, err end
	local bb, berr = M.bb_request(job_desc.script)
	if berr then return slurm.ERROR, berr end
	local bb2, berr2 = M.bb_request(job_desc.burst_buffer)
	if berr2 then return slurm.ERROR, berr2 end
	if bb2 then bb = bb and (bb .. "," .. bb2) or bb2 end
	if bb and value and bb ~= value then
		-- both ways of asking: one list (parse() drops the repeats)
		value = value .. "," .. bb
	elseif bb then
		value = bb
	end
	if value == nil then return slurm.SUCCESS end
	local names, perr = M.parse(value)
	if names == nil then return slurm.ERROR, perr end
	local cat, cerr = M.catalog()
	if cat == nil then return slurm.ERROR, cerr end
	local rc, msg = M.validate(cat, names, submit_uid)
	if rc ~= slurm.SUCCESS then return rc, msg end
	local partitions = M.partitions(job_desc, part_list)
	if not M.in_rollout(cat, partitions) then
		-- a pilot elsewhere: as if dsstage were not installed (the node side runs it from the
		-- source), or refused where the admins chose so (rollout.outside: refuse)
		if cat.rollout.outside == "refuse" then
			return slurm.ERROR, "dsstage: datasets are staged only in partition(s) " .. M.pilot(cat) ..
				" for now; submit to one of them (--partition=...) or without --dataset"
		end
		return slurm.SUCCESS
	end
	rc, msg = M.fits(cat, names, M.nodes(job_desc))
	if rc ~= slurm.SUCCESS then return rc, msg end
	M.record(job_desc, names)
	M.prefer(job_desc, names, cat)
	return slurm.SUCCESS
end

-- The partitions a job may run in: its --partition (a comma list), else the default partition
-- (the one of part_list whose flag_default is set); an empty list when neither is known.
function M.partitions(job_desc, part_list)
	local out = {}
	local given = job_desc.partition
	if type(given) == "string" and given ~= "" then
		for name in string.gmatch(given, "[^,%s]+") do out[#out + 1] = name end
		return out
	end
	if type(part_list) ~= "table" then return out end
	for key, part in pairs(part_list) do
		-- slurmctld's partition records are read through a metatable: guard every field
		local ok, flag = pcall(function() return part.flag_default end)
		if ok and tonumber(flag) == 1 then
			local named, name = pcall(function() return part.name end)
			out[#out + 1] = (named and type(name) == "string" and name) or tostring(key)
		end
	end
	return out
end

-- Whether dsstage acts for a job that may run in these partitions: every partition when the
-- catalog names no pilot (rollout.partitions), or when the job's are not known; else when one
-- of them is in the pilot (dsstage.node.rollout.job_in_scope, the same rule).
function M.in_rollout(cat, partitions)
	local r = cat.rollout
	if type(r) ~= "table" or type(r.partitions) ~= "table" or #partitions == 0 then return true end
	for _, p in ipairs(partitions) do
		if r.partitions[p] then return true end
	end
	return false
end

-- The pilot's partitions, for a message.
function M.pilot(cat)
	local names = {}
	for p, _ in pairs(cat.rollout.partitions) do names[#names + 1] = p end
	table.sort(names)
	return table.concat(names, ", ")
end

-- slurm.SUCCESS if every name is in the catalog cat (M.catalog()) and uid may use it (uid
-- nil: not checked, as burst_buffer.lua on Slurm 22.05, which is not told the user); else
-- slurm.ERROR and a one-line message for the user.
function M.validate(cat, names, submit_uid)
	local uid = tonumber(submit_uid)
	for _, name in ipairs(names) do
		local ds = cat.datasets[name]
		if ds == nil then
			return slurm.ERROR, "dsstage: unknown dataset '" .. name .. "'" .. suggest(name, cat.datasets) ..
				"; `dsstage ls` lists the catalog"
		end
		if uid ~= nil then
			local ok, aerr = may_use(name, ds, uid)
			if aerr then return slurm.ERROR, aerr end
			if not ok then
				return slurm.ERROR, "dsstage: dataset '" .. name .. "' is restricted to group(s) " ..
					table.concat(ds.groups, ", ") .. "; you are in none of them: ask the dataset's owners for access" ..
					regenerated(cat)
			end
		end
	end
	return slurm.SUCCESS
end

-- The fewest nodes the job asks for: --nodes (its minimum), else what --ntasks and
-- --ntasks-per-node make, else 1 (Slurm's default).
local NO_VAL = 0xfffffffe
function M.nodes(job_desc)
	local n = tonumber(job_desc.min_nodes)
	if n ~= nil and n >= 1 and n < NO_VAL then return n end
	local tasks, per = tonumber(job_desc.num_tasks), tonumber(job_desc.ntasks_per_node)
	if tasks and per and tasks >= 1 and tasks < NO_VAL and per >= 1 and per < 0xffff then
		return math.ceil(tasks / per)
	end
	return 1
end

-- slurm.SUCCESS if a job on `nodes` nodes can hold each dataset under its tier's high
-- watermark (the catalog's room per node, where export-catalog could size it); else
-- slurm.ERROR and what to ask for: a sharded dataset needs the catalog's least node count,
-- one without shards must fit on one node.
function M.fits(cat, names, nodes)
	for _, name in ipairs(names) do
		local ds = cat.datasets[name]
		if type(ds) == "table" and type(ds.room) == "number" and type(ds.bytes) == "number" then
			if type(ds.shards) == "number" then
				if type(ds.least) ~= "number" then
					return slurm.ERROR, "dsstage: a shard of '" .. name .. "' is larger than a node holds (" ..
						ds.room_text .. "): the admins must split it into more shards"
				end
				if nodes < ds.least then
					return slurm.ERROR, "dsstage: " .. name .. " is " .. ds.size .. " in " .. ds.shards ..
						" shards; each node holds " .. ds.room_text .. ": ask for at least " .. ds.least ..
						" nodes (--nodes=" .. ds.least .. ")"
				end
			elseif ds.bytes > ds.room then
				return slurm.ERROR, "dsstage: " .. name .. " is " .. ds.size .. ", more than a node holds (" ..
					ds.room_text .. "): it cannot be staged; the admins can declare it with shards: N to " ..
					"spread it over a job's nodes"
			end
		end
	end
	return slurm.SUCCESS
end

-- The Slurm series `dsstage export-catalog` found (the catalog's slurm_version), as a number
-- (22.05 is 2205), or nil where the catalog does not say.
function M.series(cat)
	local v = type(cat) == "table" and cat.slurm_version
	local major, minor = string.match(type(v) == "string" and v or "", "^(%d+)%.(%d+)")
	if major then return tonumber(major) * 100 + tonumber(minor) end
	return nil
end

-- A soft preference for nodes that hold the datasets ready (the demand poller keeps a node
-- feature per ready dataset, see dsstage.cluster.features): the job starts where its data is when
-- such a node is free, anywhere otherwise. A job's own --prefer is left as the user gave it.
-- Needs SchedulerParameters=ignore_prefer_validation: a feature no node has yet is
-- otherwise refused at submit. Not for a job array on Slurm 22.05 (or a catalog that does
-- not say its series): there an array that prefers a feature no node has stays pending
-- (BadConstraints) for good; 23.02 and later schedule it anywhere, as any other job.
-- Not for a job that names its nodes (-w): the choice is the user's, and on 24.11 and later a
-- preference the named nodes cannot meet leaves the job BadConstraints while they are busy, at
-- times for good (seen on the devcluster).
function M.prefer(job_desc, names, cat)
	local p = cat.placement
	if type(p) ~= "table" or not p.prefer or (job_desc.prefer ~= nil and job_desc.prefer ~= "") then
		return
	end
	local series = M.series(cat)
	if (series == nil or series < 2302) and job_desc.array_inx ~= nil and job_desc.array_inx ~= "" then
		return
	end
	if job_desc.req_nodes ~= nil and job_desc.req_nodes ~= "" then
		return
	end
	local feats = {}
	for i, name in ipairs(names) do feats[i] = p.prefix .. name end
	job_desc.prefer = M.preference(job_desc.features, table.concat(feats, "&"))
end

-- The preference for a job with constraint FEATURES (its -C, or nil) and dataset features
-- DATA ("ds_a&ds_b"), or nil for none. Slurm's --prefer "will override whatever is set
-- [by --constraint] if possible" (sbatch(1)): with -C gpu --prefer=ds_x a job starts on a node
-- with ds_x and no gpu, on 22.05, 24.11 and 26.05 alike. So the preference carries the
-- constraint too: "gpu&ds_x", "(gpu|bigmem)&ds_x". A constraint --prefer cannot say (counts,
-- brackets: refused at submit) gets no preference, and the job runs where its constraint says.
function M.preference(features, data)
	if features == nil or features == "" then return data end
	if string.find(features, "^[%w_%-%.&]+$") then
		return features .. "&" .. data
	end
	if string.find(features, "^[%w_%-%.&|]+$") then
		return "(" .. features .. ")&" .. data
	end
	return nil
end

-- Record the accepted request in admin_comment (users cannot edit it).
function M.record(job_desc, names)
	local tag = "dsstage=" .. table.concat(names, ",")
	local old = job_desc.admin_comment
	if old == nil or old == "" then
		job_desc.admin_comment = tag
	else
		old = string.gsub(old, "%s*dsstage=[^%s]*", "")
		job_desc.admin_comment = (old == "" and tag) or (old .. " " .. tag)
	end
end

return M
